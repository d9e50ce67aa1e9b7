"""Keep torch.compile out of the backend's Python methods, which torch's C++ calls back.

``torch.compile(DDP(model))`` runs DDP's buffer broadcast (``dist._broadcast_coalesced``)
with Dynamo's frame hook still set, so the C++ call back into a Python ProcessGroup's
``broadcast`` is caught as a new frame to compile, and Dynamo refuses the group (an opaque
object): ``UnsafeScriptObjectError: ... Member '_start' is not registered``. gloo's methods
are C++ and never caught. Marking our methods' code objects to be skipped, with everything
they call, runs them as plain Python, as ``torch.compiler.disable`` would; it is done
through torch's C hook because importing ``torch._dynamo`` takes seconds that every job
would pay.
"""

from __future__ import annotations

import inspect

__all__ = ["run_eagerly_under_compile"]


def run_eagerly_under_compile(*classes: type) -> None:
    """Make torch.compile run the methods that ``classes`` define (and what they call) eagerly.

    Args:
        classes: classes whose own methods, properties included, torch's C++ may call.
    """
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # a torch without Dynamo: nothing catches frames
        return
    # Private API (torch._dynamo.eval_frame.skip_code uses it): without it, compiling a DDP
    # over this backend fails as above, so a torch that renamed it fails the same way, no worse.
    try:
        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    except AttributeError:
        return
    for cls in classes:
        for member in vars(cls).values():
            function = getattr(member, "fget", member)
            if inspect.isfunction(function):
                eval_frame.set_code_exec_strategy(function.__code__, skip)
