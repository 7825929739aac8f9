"""The shared runtime of both stages (not the cache format, and no stage's settings): the config composer
and its loading with dotted overrides, console-script dispatch and error handling, logging, the distributed
set-up, and the CPU thread budget. ``dflash_cache`` proper (one level up) is the on-disk cache contract.

Why here and not a package of its own: the product's top-level layout is fixed (``dflash_cache/``,
``extract/``, ``train/``, ``configs/``, ``tests/``), and both stages already depend on ``dflash_cache``, so
this is the one place below both where shared code can live without a new top-level name or a stage
importing the other. It holds no stage's fields: each section is declared by its stage
(``extract/config.py``, ``train/config.py``, the cache's ``dflash_cache/config.py``) and only
:mod:`.schema` composes them.
"""
