"""The error a user can fix by changing the input of a run (its data, target, checkpoint or cluster) rather than its
config file (pipeline.config.ConfigError): every layer raises it, the CLI reports it as one line with exit status 2."""


class InputError(ValueError):
    """Bad input the user can fix; reported as one line, exit status 2."""
