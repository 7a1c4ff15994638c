/* gpupool._fast: the per-tensor steps of gpupool.torch's send and receive in C, so that a
 * message of many tensors does not pay a Python frame and a dozen Python objects for each.
 *
 *   reduce_tensor(t): the reducer pickle calls for each tensor (see _torch_send._reduce_tensor,
 *     to which it hands every case but the common one).
 *   views(from_dlpack, device_type, device_id, items): one torch tensor per item, each a view
 *     of gpupool memory made through DLPack. The DLManagedTensor, its shape and strides are
 *     one malloc, and its deleter (a C function, called by torch from any thread when the
 *     storage goes) drops the item's owner, the hold on the buffer. The pure-Python path
 *     builds the same structs through ctypes and calls back into Python to delete them.
 *   _rebuild_batched(...): what pickle calls for each tensor of a message (see
 *     _torch_recv._rebuild_batched, which it replaces and whose name it keeps, so that a
 *     message pickled here unpickles where the extension is absent, and the other way round).
 *   live(): how many views' deleters have not run yet (_dlpack.live_exports adds it).
 *
 * Built against the stable ABI (Py_LIMITED_API, CPython 3.8 and later): one build serves
 * every interpreter of the wheel. gpupool._native loads it, or says once why it cannot and
 * leaves gpupool.torch on its pure-Python path, which behaves the same. */
#define Py_LIMITED_API 0x03080000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

/* DLPack's ABI before 1.0 (capsule "dltensor"), the one _dlpack.view_capsules writes. */
typedef struct {
  int32_t device_type;
  int32_t device_id;
} dl_device;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} dl_dtype;

typedef struct {
  void *data;
  dl_device device;
  int32_t ndim;
  dl_dtype dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} dl_tensor;

typedef struct dl_managed {
  dl_tensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct dl_managed *self);
} dl_managed;

/* One export: the struct torch reads, the owner it keeps alive, then shape and strides. */
typedef struct {
  dl_managed m;
  PyObject *owner;
  int64_t dims[];
} export_t;

/* Attribute and method names, interned once: a C string would be made into one per call. */
#define NAMES(X) X(add) X(batch) X(cpu) X(device) X(dtype) X(is_leaf) X(is_nested) X(layout) X(made) X(nbytes) X(received) X(requires_grad) X(size) X(storage_offset) X(stride) X(type) X(untyped_storage) X(usable)
#define DECLARE(n) static PyObject *S_##n;
NAMES(DECLARE)
#undef DECLARE

static atomic_long live_exports;

static const char NAME_LEGACY[] = "dltensor";

static void export_delete(dl_managed *m) {
  export_t *e = (export_t *)m;
  /* A tensor freed after the interpreter is gone (torch's own teardown): the owner went with
   * it, and taking the GIL then would hang. */
  if (Py_IsInitialized()) {
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF(e->owner);
    PyGILState_Release(g);
  }
  atomic_fetch_sub(&live_exports, 1);
  free(e);
}

/* A capsule nobody consumed still has its first name: its export is ours to delete. A
 * consumer renames it ("used_dltensor") and calls the deleter itself later. */
static void capsule_destructor(PyObject *cap) {
  if (PyCapsule_IsValid(cap, NAME_LEGACY)) {
    dl_managed *m = PyCapsule_GetPointer(cap, NAME_LEGACY);
    if (m != NULL)
      m->deleter(m);
  }
}

/* The sizes of a shape or strides tuple into out (ndim of them). */
static int read_dims(PyObject *seq, Py_ssize_t ndim, int64_t *out, const char *what) {
  if (!PyTuple_Check(seq) || PyTuple_Size(seq) != ndim) {
    PyErr_Format(PyExc_ValueError, "gpupool._fast.views: %s must be a tuple of %zd ints", what, ndim);
    return -1;
  }
  for (Py_ssize_t i = 0; i < ndim; i++) {
    long long v = PyLong_AsLongLong(PyTuple_GetItem(seq, i));
    if (v == -1 && PyErr_Occurred())
      return -1;
    out[i] = v;
  }
  return 0;
}

/* One tensor of an item (data, (code, bits), shape, strides, owner). */
static PyObject *view_of(PyObject *from_dlpack, int dev_type, int dev_id, PyObject *item) {
  unsigned long long data;
  unsigned char code, bits;
  PyObject *shape, *strides, *owner;
  if (!PyTuple_Check(item)) {
    PyErr_SetString(PyExc_TypeError, "gpupool._fast.views: an item must be a tuple "
                                     "(data, (code, bits), shape, strides, owner)");
    return NULL;
  }
  if (!PyArg_ParseTuple(item, "K(bb)OOO", &data, &code, &bits, &shape, &strides, &owner))
    return NULL;
  if (!PyTuple_Check(shape)) {
    PyErr_SetString(PyExc_ValueError, "gpupool._fast.views: shape must be a tuple of ints");
    return NULL;
  }
  Py_ssize_t ndim = PyTuple_Size(shape);
  export_t *e = malloc(sizeof(*e) + sizeof(int64_t) * 2 * (size_t)(ndim ? ndim : 1));
  if (e == NULL)
    return PyErr_NoMemory();
  if (read_dims(shape, ndim, e->dims, "shape") < 0 ||
      read_dims(strides, ndim, e->dims + ndim, "strides") < 0) {
    free(e);
    return NULL;
  }
  e->m.dl_tensor.data = (void *)(uintptr_t)data;
  e->m.dl_tensor.device.device_type = dev_type;
  e->m.dl_tensor.device.device_id = dev_id;
  e->m.dl_tensor.ndim = (int32_t)ndim;
  e->m.dl_tensor.dtype.code = code;
  e->m.dl_tensor.dtype.bits = bits;
  e->m.dl_tensor.dtype.lanes = 1;
  e->m.dl_tensor.shape = e->dims;
  e->m.dl_tensor.strides = e->dims + ndim;
  e->m.dl_tensor.byte_offset = 0;
  e->m.manager_ctx = NULL;
  e->m.deleter = export_delete;
  Py_INCREF(owner);
  e->owner = owner;
  atomic_fetch_add(&live_exports, 1);
  PyObject *cap = PyCapsule_New(&e->m, NAME_LEGACY, capsule_destructor);
  if (cap == NULL) {
    export_delete(&e->m);
    return NULL;
  }
  /* On failure the capsule keeps its name, and dropping it deletes the export. */
  PyObject *t = PyObject_CallFunctionObjArgs(from_dlpack, cap, NULL);
  Py_DECREF(cap);
  return t;
}

static PyObject *fast_views(PyObject *self, PyObject *args) {
  PyObject *from_dlpack, *items;
  int dev_type, dev_id;
  (void)self;
  if (!PyArg_ParseTuple(args, "OiiO!", &from_dlpack, &dev_type, &dev_id, &PyList_Type, &items))
    return NULL;
  Py_ssize_t n = PyList_Size(items);
  PyObject *out = PyList_New(n);
  if (out == NULL)
    return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PyList_GetItem(items, i); /* NULL if the list shrank meanwhile */
    PyObject *t = item ? view_of(from_dlpack, dev_type, dev_id, item) : NULL;
    if (t == NULL) {
      Py_DECREF(out); /* the tensors made so far go, and their owners with them */
      return NULL;
    }
    PyList_SetItem(out, i, t);
  }
  return out;
}

static PyObject *fast_live(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong(atomic_load(&live_exports));
}

/* What _rebuild_batched needs of _torch_recv, given once by setup(): the thread-local that
 * holds the message's storages (.received) and tensors made whole (.made), the Python
 * functions for the rarer cases, and torch.Tensor. */
static PyObject *g_tls, *g_rebuild_tensor, *g_as_sent, *g_tensor_type, *g_zero;

/* setup() and setup_send(): the four objects of args into *slot[0..3], a reference to each
 * taken, and only then those they replace let go (letting go may run Python code). */
static PyObject *set_four(PyObject *args, PyObject **slot[4]) {
  PyObject *v[4], *old[4];
  if (!PyArg_ParseTuple(args, "OOOO", &v[0], &v[1], &v[2], &v[3]))
    return NULL;
  for (int k = 0; k < 4; k++) {
    Py_INCREF(v[k]);
    old[k] = *slot[k];
    *slot[k] = v[k];
  }
  for (int k = 0; k < 4; k++)
    Py_XDECREF(old[k]);
  Py_RETURN_NONE;
}

static PyObject *fast_setup(PyObject *self, PyObject *args) {
  PyObject **slot[4] = {&g_tls, &g_rebuild_tensor, &g_as_sent, &g_tensor_type};
  (void)self;
  return set_four(args, slot);
}

/* getattr(obj, name, None) as a new reference; NULL only on an error other than its absence. */
static PyObject *attr_or_none(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    Py_INCREF(Py_None);
    v = Py_None;
  }
  return v;
}

/* Whether obj.method() == want: 1, 0, or -1 on an error. */
static int call_equals(PyObject *obj, PyObject *method, PyObject *want) {
  PyObject *v = PyObject_CallMethodObjArgs(obj, method, NULL);
  if (v == NULL)
    return -1;
  int eq = PyObject_RichCompareBool(v, want, Py_EQ);
  Py_DECREF(v);
  return eq;
}

/* Whether t, a tensor made whole from memory, is the one the sender described. */
static int is_as_described(PyObject *t, PyObject *dtype, PyObject *offset, PyObject *size,
                           PyObject *stride) {
  int eq = PyObject_RichCompareBool(offset, g_zero, Py_EQ);
  if (eq != 1)
    return eq;
  PyObject *td = PyObject_GetAttr(t, S_dtype);
  if (td == NULL)
    return -1;
  eq = PyObject_RichCompareBool(td, dtype, Py_EQ);
  Py_DECREF(td);
  if (eq != 1)
    return eq;
  /* torch.Size equals a tuple of the same sizes */
  eq = call_equals(t, S_size, size);
  if (eq != 1)
    return eq;
  return call_equals(t, S_stride, stride);
}

static PyObject *fast_rebuild_batched(PyObject *self, PyObject *args) {
  PyObject *cls, *i, *dtype, *offset, *size, *stride, *requires_grad;
  PyObject *got = NULL, *made = NULL, *t = NULL, *res = NULL;
  (void)self;
  if (!PyArg_ParseTuple(args, "OOOOOOO", &cls, &i, &dtype, &offset, &size, &stride, &requires_grad))
    return NULL;
  if (g_tls == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "gpupool._fast._rebuild_batched called before setup()");
    return NULL;
  }
  got = attr_or_none(g_tls, S_received);
  if (got == NULL)
    goto out;
  if (got == Py_None) {
    PyErr_SetString(PyExc_RuntimeError, "a gpupool.torch tensor unpickled outside its message");
    goto out;
  }
  made = attr_or_none(g_tls, S_made);
  if (made == NULL)
    goto out;
  if (PyDict_Check(made) && PyDict_Size(made) > 0) {
    t = PyDict_GetItem(made, i); /* borrowed; no error raised */
    if (t != NULL) {
      Py_INCREF(t);
      if (PyDict_DelItem(made, i) < 0)
        goto out;
    }
  }
  if (t != NULL) {
    int ok = is_as_described(t, dtype, offset, size, stride);
    if (ok < 0)
      goto out;
    if (ok) {
      int rg = PyObject_IsTrue(requires_grad);
      if (rg < 0)
        goto out;
      if (cls != g_tensor_type) {
        res = PyObject_CallFunctionObjArgs(g_as_sent, cls, t, requires_grad, NULL);
        goto out;
      }
      if (rg && PyObject_SetAttr(t, S_requires_grad, Py_True) < 0)
        goto out;
      res = t;
      t = NULL;
      goto out;
    }
  }
  {
    PyObject *st = PyObject_GetItem(got, i);
    if (st == NULL)
      goto out;
    res = PyObject_CallFunctionObjArgs(g_rebuild_tensor, cls, st, dtype, offset, size, stride,
                                       requires_grad, NULL);
    Py_DECREF(st);
  }
out:
  Py_XDECREF(t);
  Py_XDECREF(made);
  Py_XDECREF(got);
  return res;
}

/* What reduce_tensor needs of _torch_send, given once by setup_send(): the thread-local of the
 * message being pickled (.batch), the Python reducer for every case but the common one, the
 * rebuild function a tensor is pickled with, and torch.strided. */
static PyObject *g_send_tls, *g_py_reduce, *g_rebuild, *g_strided;

static PyObject *fast_setup_send(PyObject *self, PyObject *args) {
  PyObject **slot[4] = {&g_send_tls, &g_py_reduce, &g_rebuild, &g_strided};
  (void)self;
  return set_four(args, slot);
}

/* obj.name as a truth value: 1, 0, or -1 on an error. */
static int attr_true(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL)
    return -1;
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

/* obj.method() as a tuple (torch.Size is one already; stride() gives one). */
static PyObject *call_tuple(PyObject *obj, PyObject *method) {
  PyObject *v = PyObject_CallMethodObjArgs(obj, method, NULL);
  if (v == NULL || PyTuple_CheckExact(v))
    return v;
  PyObject *t = PySequence_Tuple(v);
  Py_DECREF(v);
  return t;
}

/* The common case of _torch_send._reduce_tensor, for which pickle calls this directly: a
 * strided tensor of a message being pickled (ForkingPickler.dump), on a device gpupool.torch
 * serves, that gpupool serves (asked at the message's first tensor), not a non-leaf requiring
 * grad, with a storage of some bytes. Anything else goes to the Python reducer as it is, so
 * that both paths decide the same. Returns 1 with *out set, 0 for "not the common case", -1 on
 * an error. */
static int reduce_common(PyObject *t, PyObject *batch, PyObject **out) {
  PyObject *dev = NULL, *st = NULL, *args = NULL, *v = NULL;
  int rc = -1, r;
  *out = NULL;
  if ((r = attr_true(batch, S_usable)) != 1)
    return r;
  if ((r = attr_true(t, S_is_nested)) != 0)
    return r < 0 ? -1 : 0;
  v = PyObject_GetAttr(t, S_layout);
  if (v == NULL)
    return -1;
  r = v == g_strided;
  Py_CLEAR(v);
  if (!r)
    return 0;
  dev = PyObject_GetAttr(t, S_device);
  if (dev == NULL)
    return -1;
  v = PyObject_GetAttr(dev, S_type);
  if (v == NULL)
    goto out;
  if (PyUnicode_CompareWithASCIIString(v, "cuda") != 0) {
    /* CPU tensors only with install(cpu=True), which the message noted as it began */
    r = PyUnicode_CompareWithASCIIString(v, "cpu") == 0 ? attr_true(batch, S_cpu) : 0;
    if (r != 1) {
      rc = r;
      goto out;
    }
  }
  Py_CLEAR(v);
  PyObject *rg = PyObject_GetAttr(t, S_requires_grad);
  if (rg == NULL)
    goto out;
  if ((r = PyObject_IsTrue(rg)) != 0) {
    int leaf = r < 0 ? -1 : attr_true(t, S_is_leaf);
    if (leaf != 1) { /* the Python reducer raises torch's own error */
      Py_DECREF(rg);
      rc = leaf < 0 ? -1 : 0;
      goto out;
    }
  }
  st = PyObject_CallMethodObjArgs(t, S_untyped_storage, NULL);
  if (st == NULL || (v = PyObject_CallMethodObjArgs(st, S_nbytes, NULL)) == NULL) {
    Py_DECREF(rg);
    goto out;
  }
  r = PyObject_IsTrue(v);
  Py_CLEAR(v);
  if (r != 1) {
    Py_DECREF(rg);
    rc = r < 0 ? -1 : 0;
    goto out;
  }
  args = PyTuple_New(7);
  if (args == NULL) {
    Py_DECREF(rg);
    goto out;
  }
  PyObject *cls = (PyObject *)Py_TYPE(t);
  Py_INCREF(cls);
  PyTuple_SetItem(args, 0, cls);
  PyTuple_SetItem(args, 6, rg);
  /* One at a time, in this order, stopping at the first that raises: nothing more is called
   * with an exception set (it would come back as a SystemError hiding the real one). */
  for (int k = 0; k < 5; k++) {
    PyObject *it;
    switch (k) {
    case 0:
      it = PyObject_CallMethodObjArgs(batch, S_add, st, dev, t, NULL);
      break;
    case 1:
      it = PyObject_GetAttr(t, S_dtype);
      break;
    case 2:
      it = PyObject_CallMethodObjArgs(t, S_storage_offset, NULL);
      break;
    case 3:
      it = call_tuple(t, S_size);
      break;
    default:
      it = call_tuple(t, S_stride);
    }
    if (it == NULL)
      goto out;
    PyTuple_SetItem(args, 1 + k, it);
  }
  *out = PyTuple_Pack(2, g_rebuild, args);
  rc = *out != NULL ? 1 : -1;
out:
  Py_XDECREF(args);
  Py_XDECREF(v);
  Py_XDECREF(st);
  Py_DECREF(dev);
  return rc;
}

static PyObject *fast_reduce_tensor(PyObject *self, PyObject *t) {
  (void)self;
  if (g_send_tls == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "gpupool._fast.reduce_tensor called before setup_send()");
    return NULL;
  }
  PyObject *batch = attr_or_none(g_send_tls, S_batch);
  if (batch == NULL)
    return NULL;
  PyObject *out = NULL;
  int r = batch == Py_None ? 0 : reduce_common(t, batch, &out);
  Py_DECREF(batch);
  if (r < 0)
    return NULL;
  if (r == 1)
    return out;
  return PyObject_CallFunctionObjArgs(g_py_reduce, t, NULL);
}

static PyMethodDef methods[] = {
  {"reduce_tensor", fast_reduce_tensor, METH_O,
   "reduce_tensor(t): _torch_send._reduce_tensor, its common case in C."},
  {"setup_send", fast_setup_send, METH_VARARGS,
   "setup_send(tls, py_reduce, rebuild, strided): what reduce_tensor reads."},
  {"views", fast_views, METH_VARARGS,
   "views(from_dlpack, device_type, device_id, items): a tensor per (data, (code, bits), "
   "shape, strides, owner), a DLPack view keeping owner until torch lets go of it."},
  {"live", fast_live, METH_NOARGS, "live(): views whose deleter has not run yet."},
  {"setup", fast_setup, METH_VARARGS,
   "setup(tls, rebuild_tensor, as_sent, tensor_type): what _rebuild_batched reads."},
  {NULL, NULL, 0, NULL},
};

/* Pickled by name as gpupool._torch_recv._rebuild_batched (its __module__ says so), the name
 * the pure-Python function has: either side may lack the extension. */
static PyMethodDef rebuild_def = {
  "_rebuild_batched", fast_rebuild_batched, METH_VARARGS,
  "A tensor of a received message (gpupool._torch_recv._rebuild_batched, in C).",
};

static struct PyModuleDef module_def = {
  PyModuleDef_HEAD_INIT, "gpupool._fast", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fast(void);

PyMODINIT_FUNC PyInit__fast(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (m == NULL)
    return NULL;
  PyObject *modname = PyUnicode_FromString("gpupool._torch_recv");
  PyObject *fn = modname != NULL ? PyCFunction_NewEx(&rebuild_def, NULL, modname) : NULL;
  Py_XDECREF(modname);
  if (fn == NULL || PyModule_AddObject(m, "rebuild_batched", fn) < 0) {
    Py_XDECREF(fn);
    Py_DECREF(m);
    return NULL;
  }
#define INTERN(n)                                                            \
  if (S_##n == NULL && (S_##n = PyUnicode_InternFromString(#n)) == NULL) { \
    Py_DECREF(m);                                                            \
    return NULL;                                                             \
  }
  NAMES(INTERN)
#undef INTERN
  if (g_zero == NULL && (g_zero = PyLong_FromLong(0)) == NULL) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
