"""A griffe extension for the API reference: a re-exported name wins over a submodule of the same name.

``hpcddp/__init__.py`` imports functions whose names are also submodules of the package
(``hpcddp.device`` is ``bootstrap.device``, not the module ``device.py``), as Python sees
them after ``import hpcddp``. griffe keeps the submodule instead (an object cannot hold both,
see https://mkdocstrings.github.io/griffe/guide/users/recommendations/python-code/), so
``::: hpcddp.device`` would document the module. This puts the imported object back for
every name in ``__all__``.
"""

from __future__ import annotations

from typing import Any

import griffe


class ReexportsOverSubmodules(griffe.Extension):
    """Make each name in a package's ``__all__`` that its ``__init__`` imports an alias to that import."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in [pkg, *(m for m in pkg.modules.values() if m.is_package)]:
            for name in module.exports or ():
                target = module.imports.get(name)
                member = module.members.get(name)
                if target and member is not None and not member.is_alias and member.is_module:
                    module.set_member(name, griffe.Alias(name, target, parent=module))
