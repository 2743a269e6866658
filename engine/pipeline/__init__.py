"""Pipeline parallelism: schedules as data, a process-free simulator, partitioning, executor.

- :mod:`engine.pipeline.actions`: the instruction set (``F3``, ``B2``, ``SEND_ACT3`` ...).
- :mod:`engine.pipeline.schedule`: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, dualpipe-v as pure functions
  (the V-shaped orders in :mod:`engine.pipeline.vshape`).
- :mod:`engine.pipeline.simulate`: pairs sends with receives, detects deadlock, times a schedule.
- :mod:`engine.pipeline.partition`: layers to stages.
- :mod:`engine.pipeline.executor`: runs one rank's action list with point-to-point comms.
- :mod:`engine.pipeline.timeline`: Chrome trace and PNG Gantt chart of a recorded step.
"""

from engine.pipeline.actions import Action, ActionKind, ScheduleError, parse_action
from engine.pipeline.partition import PARTITION_METHODS, layers_of, partition_layers
from engine.pipeline.schedule import SCHEDULES, build_all, build_schedule, schedule_table
from engine.pipeline.simulate import SimResult, bubble_formula, simulate

__all__ = ["Action", "ActionKind", "ScheduleError", "parse_action", "SCHEDULES", "build_all",
           "build_schedule", "schedule_table", "SimResult", "bubble_formula", "simulate",
           "PARTITION_METHODS", "partition_layers", "layers_of"]
