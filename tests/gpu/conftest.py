"""With TRITON_INTERPRET=1 (kernel development on a CPU), Triton 3.6's interpreter turns a loaded scalar used as a
loop bound into a 1-element numpy array that numpy 2 refuses to convert with int(); unwrap it. Nothing changes on
a GPU, where kernels are compiled."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    import numpy as np
    from triton.runtime import interpreter

    _patch_lang = interpreter._patch_lang

    def _patch_lang_with_scalar_index(fn):
        scope = _patch_lang(fn)
        scope.set_attr(interpreter.tl.core.tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
        return scope

    interpreter._patch_lang = _patch_lang_with_scalar_index
