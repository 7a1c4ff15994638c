"""A call that needs a framework that is not installed (NumPy, torch, CuPy) raises
FrameworkMissingError: a GpupoolError and an ImportError whose message says what to install,
never a bare ModuleNotFoundError. Each case runs in a child process where the framework's
import is blocked (sys.modules[name] = None makes `import name` fail as if it were absent),
against a real daemon."""

import json
import subprocess
import sys
import textwrap

from support import DaemonTestCase, child_env

CHILD = textwrap.dedent("""
    import json, sys
    blocked, call = sys.argv[1], sys.argv[2]
    sys.modules[blocked] = None
    import gpupool
    c = gpupool.Client(name="frameworks")
    t = c.alloc((2, 3), "float32")
    td = c.alloc_dict({"x": ((4,), "int32")})
    try:
        if call == "tensor.numpy":
            t.numpy()
        elif call == "dict.numpy":
            td.numpy()
        elif call == "dict.torch":
            td.torch()
        elif call == "dict.cupy":
            td.cupy()
        raise SystemExit("no error")
    except Exception as e:
        print(json.dumps({"types": [k.__name__ for k in type(e).__mro__],
                          "gpupool": isinstance(e, gpupool.GpupoolError),
                          "missing": isinstance(e, gpupool.FrameworkMissingError),
                          "module": getattr(e, "module", None), "message": str(e)}))
""")


class MissingFramework(DaemonTestCase):
    def run_child(self, blocked, call):
        p = subprocess.run([sys.executable, "-c", CHILD, blocked, call], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=child_env(self.socket),
                           timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def check(self, blocked, call, install):
        got = self.run_child(blocked, call)
        self.assertTrue(got["missing"], got)
        self.assertTrue(got["gpupool"], got)
        self.assertIn("ImportError", got["types"], got)
        self.assertEqual(got["module"], blocked, got)
        self.assertIn(install, got["message"], got)

    def test_tensor_numpy_names_the_extra(self):
        self.check("numpy", "tensor.numpy", "pip install 'gpupool[numpy]'")

    def test_dict_numpy_names_the_extra(self):
        self.check("numpy", "dict.numpy", "pip install 'gpupool[numpy]'")

    def test_dict_torch(self):
        self.check("torch", "dict.torch", "pip install torch")

    def test_dict_cupy(self):
        self.check("cupy", "dict.cupy", "pip install cupy")
