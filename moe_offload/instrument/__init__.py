"""Instruments kept out of the hot code: routing traces, phase timers, A/B switches."""
