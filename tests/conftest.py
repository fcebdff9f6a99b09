"""Test-wide settings: under CI (CI=true) hypothesis replays a fixed set of examples, so a run is reproducible."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
