"""The microkernel: messages, bus, actor base, clocks, seeds and traces. Imports no torch."""
