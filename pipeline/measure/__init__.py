"""Measurement on the device at hand: the cost profile (a draft step and a verify pass against a target step), batched
passes, the speculation profile of a collect, the host's per-pass overhead, and bootstrap intervals."""
