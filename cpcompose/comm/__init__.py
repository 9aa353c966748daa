"""The communication cpcompose does, in one place, with a byte meter (`collectives`)."""

from cpcompose.comm.collectives import *  # noqa: F403
from cpcompose.comm.collectives import __all__, _runs_on_gloo, _staging  # noqa: F401
