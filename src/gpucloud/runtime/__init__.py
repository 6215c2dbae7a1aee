"""Running pods as OCI containers with runc.

``bundle`` writes the runtime bundle, ``driver.RuncDriver`` starts, adopts, stops and
inspects containers, ``logs`` reads their output. ``supervisor`` is the small per-container
process that outlives the agent and records exit status; it imports only the standard
library and the modules ``layout`` and ``cgroups`` so that it starts fast — keep this
package's ``__init__`` free of imports for the same reason.
"""
