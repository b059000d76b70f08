"""The run's configuration: settings by section, TOML files and flags, and the model config and
parallel plan built from them.
"""
