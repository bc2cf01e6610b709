"""The parallel schemes, one module each, registered in ``base.SCHEMES``
(see base.py for the interface; steps.py holds the composition steps they
share). Importing this package registers them all, in the order of
job/schema.py's ``parallel.scheme`` choices; a new scheme is one module here
and one name in the line below (and, for the config language, its name and
meaning in job/schema.py: docs/DESIGN.md, "A new parallel scheme").
"""
from .base import (SCHEMES, Composition, Layout, Scheme, mode_class,  # noqa: F401
                   register_scheme, run_scheme_of, scheme_class, scheme_names,
                   scheme_of)
from . import data, param_server, none, pipeline, hybrid, tensor, sharded  # noqa: F401,E402
