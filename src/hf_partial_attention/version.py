"""The plugin's version: recorded in every saved config.json (`partial_plugin_version`) and read by packaging."""

__version__ = "0.2.0"
