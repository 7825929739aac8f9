"""The drafters (DFlash, DFlash2) and the factory that builds either, their attention, their training objective
(block losses, distillation losses), compute dtypes, and the modeling file shipped in every export
(``hf_modeling/dflash.py``)."""
