"""caramba's version, in a module of its own: records name it, and a module that imported the package
root for it would make the root (which wires the layers together) a dependency of everything."""

__version__ = "0.1.0"
