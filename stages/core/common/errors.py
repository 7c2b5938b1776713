"""The library's configuration error, raised by every layer from the config's validation down."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file and the key."""
