"""The ``rankwise`` command line; a thin typer app (:func:`main` is the console script)."""

from ._app import app as app
from ._app import main as main
