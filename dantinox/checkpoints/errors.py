"""The one error type of the checkpoint importers."""


class CheckpointError(ValueError):
    """A checkpoint cannot be imported exactly: a missing file, an unsupported config field or value, a tensor
    of the wrong shape. The message is one line naming the file, field or tensor, the value and what is allowed.
    """


class GGUFError(CheckpointError):
    """A GGUF file that cannot be imported; the message names the file and the reason (the metadata key or
    tensor at fault) in one line."""
