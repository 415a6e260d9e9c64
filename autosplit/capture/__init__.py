"""Capture: a model and one call of it become an ordered list of blocks.

- :mod:`~autosplit.capture.signature`: how a call's positional and keyword inputs become the
  graph's flat tensor inputs, and back.
- :mod:`~autosplit.capture.exported`: the torch.export front end (models torch.fx cannot
  trace: decorated forwards, control flow on shapes, Hugging Face models).
- :mod:`~autosplit.capture.layers`: which module path each operation's block is keyed on (the
  repeated layers of a model, wherever they sit).
- :mod:`~autosplit.capture.values`: which values may cross a cut (tensors), and which are
  rebuilt on the far side (sizes computed from tensors).

:func:`autosplit.capture.trace.trace` puts these together.
"""
