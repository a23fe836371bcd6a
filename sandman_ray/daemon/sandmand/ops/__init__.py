"""The operations, one module per group, as mixins of the Daemon (which holds the state):
exec, sessions, procs, files. The op table in ``wire`` names them; the Daemon answers
op ``name`` with its method ``op_<name>``."""
