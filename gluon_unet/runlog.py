"""Renamed to :mod:`gluon_unet.reporting` (issue 15); kept until every import moved."""
from .reporting import *  # noqa: F401,F403
from .reporting import LOGGER_NAME, MetricsTable, get_logger, plot_curves, setup_logging  # noqa: F401
