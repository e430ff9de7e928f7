"""Training data for ``fusion run``: what a step's batches are made of.

- :mod:`fusion.data.batches`: the batches of a plan's placeholders (generated text corpus, synthetic tensors,
  ``--data`` sources dispatched by kind), each a pure function of ``(seed, step)``.
- :mod:`fusion.data.text`: a user's text files, tokenized and cut into windows (``--data text:PATH``).
- :mod:`fusion.data.iterable`: any iterable or ``DataLoader`` a user's function returns (``--data file.py:fn``).
"""
