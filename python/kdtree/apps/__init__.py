"""The command-line apps over the engine: ``python -m kdtree`` / ``kdtree`` (:mod:`.cli`),
``demo`` (lossless DDTree decoding, checked against plain decoding), ``generate`` (a
transformer pair, greedy or sampled), and their plots and text display."""
