"""Speculative decoding: the decoder (draft + verify steps), its drafters (n-gram, a draft model, the
model's own MTP layer), rejection sampling of a verify step and the adaptive step count."""
