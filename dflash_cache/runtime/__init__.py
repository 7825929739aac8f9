"""The shared runtime of both stages (not the cache format): the config schema and its loading with
dotted overrides, console-script dispatch and error handling, logging, the distributed set-up, and the
CPU thread budget. ``dflash_cache`` proper (one level up) is the on-disk cache contract.
"""
