"""Errors the engine raises on purpose. Each message is one line naming the thing and what to do."""


class EngineError(Exception):
    """A problem the user can act on: bad prompt, settings that do not fit the model, no such device."""


class ModelLoadError(EngineError):
    """A model directory that cannot be loaded; the message names the file and the problem."""
