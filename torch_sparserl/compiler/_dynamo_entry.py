"""Target of the ``torch_dynamo_backends`` entry point.

Dynamo loads ``torch_sparserl.compiler._dynamo_entry:sparserl`` the first time a
``torch.compile`` call names the backend. That moment — the user opting in, not an
import — is when the eager interception of raw sparse CSR products is installed, because
Dynamo never calls the backend for a frame it refuses (one that takes a sparse tensor).
"""


def __getattr__(name: str):
    if name == "sparserl":
        from ..tensor import intercept
        from .backend import sparserl_backend

        intercept.activate_for_backend()
        return sparserl_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
