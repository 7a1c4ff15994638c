"""Replicas through the Python API, on the host backend: pools configured with device=N
stand for GPUs (simulated), so get(..., device=N), get_dict(..., device=N) and the devices of
a broadcast publish run here as on GPUs: the bytes of the version, in a pool of that device."""

import numpy as np

from support import DaemonTestCase
import gpupool


class Replicas(DaemonTestCase):
    pools = ("name=gpu0,kind=host,device=0,capacity=64M,slab=8M",
             "name=gpu1,kind=host,device=1,capacity=64M,slab=8M",
             "name=gpu2,kind=host,device=2,capacity=64M,slab=8M")

    def used(self, name):
        return [p for p in self.client.stats()["pools"] if p["name"] == name][0]["used"]

    def test_pools_say_they_are_simulated(self):
        by_name = {p["name"]: p for p in self.client.pools()}
        self.assertEqual(by_name["gpu1"]["simulated_device"], 1)
        self.assertEqual(by_name["gpu1"]["kind"], "host")

    def test_get_on_device_is_a_replica(self):
        c = self.client
        t = c.alloc((1000, 300), "float32", device="cuda:0")  # the pool standing for GPU 0
        a = np.arange(300000, dtype=np.float32).reshape(1000, 300)
        t.numpy()[:] = a
        c.publish("py/w", t)
        t.release()
        self.assertEqual(self.used("gpu1"), 0)
        r = c.get("py/w", timeout=5, device=1)
        self.assertTrue(r.read_only)
        self.assertTrue(np.array_equal(r.numpy(), a))
        self.assertGreater(self.used("gpu1"), 0)
        same = c.get("py/w", timeout=5, device="cuda:1")
        self.assertEqual(same.data_ptr, r.data_ptr)
        here = c.get("py/w", timeout=5)  # no device: where it lies
        self.assertNotEqual(here.data_ptr, r.data_ptr)
        for x in (r, same, here):
            x.release()
        c.unpublish("py/w")
        self.assertEqual(self.used("gpu1"), 0)

    def test_get_dict_on_device_and_broadcast(self):
        c = self.client
        d = c.alloc_dict({"a": ((64, 64), "float32"), "b": ((1000,), "int64")}, device=0)
        d["a"].numpy()[:] = 1.5
        d["b"].numpy()[:] = np.arange(1000)
        c.publish_dict("py/sd", d, devices=[1, "cuda:2"])
        d.release()
        for dev in (1, 2):
            g = c.get_dict("py/sd", timeout=5, device=dev)
            self.assertTrue(np.all(g["a"].numpy() == 1.5))
            self.assertTrue(np.array_equal(g["b"].numpy(), np.arange(1000)))
            g.release()
        self.assertGreater(self.used("gpu1"), 0)
        self.assertGreater(self.used("gpu2"), 0)
        c.unpublish("py/sd")
        self.assertEqual(self.used("gpu1"), 0)
        self.assertEqual(self.used("gpu2"), 0)

    def test_replaced_version_frees_its_replicas(self):
        # The producer keeps version 1's buffer (double buffering) and publishes version 2 in
        # another: no get can reach version 1's replica any more, so it goes at once rather than
        # when the producer lets version 1's buffer go.
        c = self.client
        v1 = c.alloc((1 << 18,), "uint8", device=0)
        v1.numpy()[:] = 1
        c.publish("py/dbl", v1, devices=[1])
        r1 = c.get("py/dbl", timeout=5, device=1)  # the broadcast's copy is done
        self.assertTrue(np.all(r1.numpy() == 1))
        r1.release()
        self.assertGreater(self.used("gpu1"), 0)
        v2 = c.alloc((1 << 18,), "uint8", device=0)
        v2.numpy()[:] = 2
        c.publish("py/dbl", v2)
        self.assertEqual(self.used("gpu1"), 0)
        r = c.get("py/dbl", timeout=5, device=1)  # version 2's own replica
        self.assertTrue(np.all(r.numpy() == 2))
        r.release()
        for x in (v1, v2):
            x.release()
        c.unpublish("py/dbl")
        self.assertEqual(self.used("gpu1"), 0)

    def test_device_without_pool(self):
        c = self.client
        t = c.alloc(16, "uint8", device=0)
        c.publish("py/x", t)
        t.release()
        with self.assertRaises(gpupool.GpupoolError) as cm:
            c.get("py/x", timeout=1, device=7)
        self.assertIn("no pool of device 7", str(cm.exception))
        with self.assertRaises(ValueError):
            c.get("py/x", timeout=1, device="tpu:0")
        c.unpublish("py/x")
