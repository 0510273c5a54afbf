"""The ``rankwise`` command line (``rankwise train``, ``rankwise demo``); a thin typer app."""

from ._app import app as app
from ._app import main as main
