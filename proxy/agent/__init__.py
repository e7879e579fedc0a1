"""The node agent (`python -m proxy [flags]`): see app.py for how it starts and stops,
runner.py for the sync loop, schedule.py for its timing."""

from proxy.agent.app import Agent, StartupError
from proxy.agent.main import cleanup, run

__all__ = ["Agent", "StartupError", "cleanup", "run"]
