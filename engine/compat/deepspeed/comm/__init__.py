"""``deepspeed.comm`` (``import deepspeed.comm as dist``): the collectives of
:mod:`engine.compat.comm` plus the rest of DeepSpeed's module (:mod:`.comm`)."""

from engine.compat.deepspeed.comm.comm import *  # noqa: F401,F403 (the module's whole public surface)
from engine.compat.deepspeed.comm.comm import __all__  # noqa: F401
