"""Offline tools on the engine's own actors: trace replay (``replay``), what-if simulation (``simulate`` and
``sim/``), this machine's step-time profile (``profile``) and trace summaries (``trace_summary``).
They import the engine and its actors; nothing in the engine imports them."""
