"""Examples: user-defined environments and configs (see README.md). A package so `module:Class` paths resolve."""
