"""Offline training of drafts for the default target (distillation); imports the engine, never imported by it."""
