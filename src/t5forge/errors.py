"""Typed errors. Library code raises these with a message that says what is wrong and what to change;
only the command line (t5forge.cli) turns them into a one-line message and exit status 2."""


class T5ForgeError(Exception):
    """Base class of every error a user can fix by changing their input."""


class ConfigError(T5ForgeError, ValueError):
    """A model or run configuration is invalid or inconsistent."""


class CheckpointError(T5ForgeError):
    """A checkpoint is missing, unreadable, or does not match the model."""


class UnknownPresetError(T5ForgeError, KeyError):
    """A preset name that t5forge does not know."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0])


class TrainingDiverged(T5ForgeError):
    """The loss or the gradients stayed non-finite for train.max_nonfinite_steps steps in a row."""
