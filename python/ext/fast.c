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
 *   storages_of(...): a received message's storages (_torch_recv._storages_of): this
 *     process's storage of memory it received before, else a new one made by views(), and
 *     the process's record of both (received memory, and what to share it by when sent on).
 *   live(): how many views' deleters have not run yet (_dlpack.live_exports adds it).
 *   setup_torch(...): torch's own C functions for views() to use where torch has them.
 *   setup_batch(...): reduce_tensor then adds a tensor to its message (_Batch.add) in C.
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
#define NAMES(X) X(_weak_ref) X(add) X(batch) X(buf) X(buffer_id) X(cpu) X(cuda) X(data_ptr) X(device) X(devs) X(dtype) X(get_device) X(index) X(is_cpu) X(is_cuda) X(is_leaf) X(is_nested) X(kind) X(layout) X(made) X(nbytes) X(ptr) X(ptrs) X(received) X(requires_grad) X(size) X(sizes) X(storage_offset) X(storages) X(stride) X(type) X(untyped_storage) X(usable) X(views)
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

/* torch's own C functions (its stable C shim, torch 2.10 and later), given by setup_torch():
 * torch_from_blob makes a tensor of memory with a C deleter, without a DLPack capsule and a
 * Python call per tensor (bench/torch_floor.py on an H200's host: 1.34 us a tensor against
 * 1.45 through DLPack; 0.54 against 0.73 on a small VM); aoti_torch_delete_tensor_object
 * drops a tensor handle nobody took; and the Python function that turns a list of handles
 * into torch tensors in one call (torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs).
 * Absent, views() goes through DLPack as before. */
typedef int32_t (*from_blob_fn)(void *data, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                int64_t storage_offset, int32_t dtype, int32_t device_type, int32_t device_index,
                                void **ret, int32_t layout, const uint8_t *opaque, int64_t opaque_size,
                                void (*deleter)(void *data, void *ctx), void *deleter_ctx);
typedef int32_t (*delete_fn)(void *handle);

#define MAX_SHIM_DIMS 16
#define NDTYPES 16

static from_blob_fn g_from_blob;
static delete_fn g_delete_handle;
static PyObject *g_wrap_handles;
/* DLPack (code, bits) -> torch's ScalarType number, as setup_torch() was told. */
static struct {
  uint8_t code, bits;
  int32_t scalar;
} g_dtypes[NDTYPES];
static int g_ndtypes;

static void blob_delete(void *data, void *ctx) {
  (void)data;
  if (Py_IsInitialized()) { /* see export_delete */
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF((PyObject *)ctx);
    PyGILState_Release(g);
  }
  atomic_fetch_sub(&live_exports, 1);
}

static PyObject *fast_setup_torch(PyObject *self, PyObject *args) {
  unsigned long long from_blob, del;
  PyObject *wrap, *types;
  (void)self;
  if (!PyArg_ParseTuple(args, "KKOO!", &from_blob, &del, &wrap, &PyTuple_Type, &types))
    return NULL;
  Py_ssize_t n = PyTuple_Size(types);
  if (n > NDTYPES) {
    PyErr_Format(PyExc_ValueError, "gpupool._fast.setup_torch: at most %d element types", NDTYPES);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned char code, bits;
    int scalar;
    if (!PyArg_ParseTuple(PyTuple_GetItem(types, i), "bbi", &code, &bits, &scalar))
      return NULL;
    g_dtypes[i].code = code;
    g_dtypes[i].bits = bits;
    g_dtypes[i].scalar = scalar;
  }
  g_ndtypes = (int)n;
  PyObject *old = g_wrap_handles;
  Py_INCREF(wrap);
  g_wrap_handles = wrap;
  Py_XDECREF(old);
  /* from_blob 0: views() goes through DLPack again */
  g_from_blob = from_blob && del ? (from_blob_fn)(uintptr_t)from_blob : NULL;
  g_delete_handle = (delete_fn)(uintptr_t)del;
  Py_RETURN_NONE;
}

static int scalar_of(unsigned char code, unsigned char bits) {
  for (int i = 0; i < g_ndtypes; i++)
    if (g_dtypes[i].code == code && g_dtypes[i].bits == bits)
      return g_dtypes[i].scalar;
  return -1;
}

/* Whether the items can all go through torch_from_blob: known element types and at most
 * MAX_SHIM_DIMS dimensions each. 1, 0, or -1 on an error. */
static int shim_fits(PyObject *items) {
  Py_ssize_t n = PyList_Size(items);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PyList_GetItem(items, i);
    if (item == NULL || !PyTuple_Check(item) || PyTuple_Size(item) != 5)
      return 0; /* view_of says what is wrong */
    PyObject *dt = PyTuple_GetItem(item, 1), *shape = PyTuple_GetItem(item, 2);
    /* torch_from_blob makes memory of its own for NULL, and never calls the deleter */
    int null = PyObject_Not(PyTuple_GetItem(item, 0));
    if (null != 0)
      return null < 0 ? -1 : 0;
    if (!PyTuple_Check(dt) || PyTuple_Size(dt) != 2 || !PyTuple_Check(shape) ||
        PyTuple_Size(shape) > MAX_SHIM_DIMS)
      return 0;
    long code = PyLong_AsLong(PyTuple_GetItem(dt, 0)), bits = PyLong_AsLong(PyTuple_GetItem(dt, 1));
    if (PyErr_Occurred())
      return -1;
    if (code < 0 || code > 255 || bits < 0 || bits > 255 || scalar_of((unsigned char)code, (unsigned char)bits) < 0)
      return 0;
  }
  return 1;
}

/* The handles of caps[0..n) dropped (tensors nobody took: their deleters let their owners go). */
static void drop_handles(PyObject *caps, Py_ssize_t n) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb); /* the caller's error is the one to report */
  for (Py_ssize_t i = 0; i < n; i++) {
    void *h = PyCapsule_GetPointer(PyList_GetItem(caps, i), NULL);
    if (h != NULL)
      g_delete_handle(h);
    PyErr_Clear();
  }
  PyErr_Restore(type, value, tb);
}

/* views() through torch_from_blob: every tensor made in C, then all turned into Python
 * tensors by one call. aten_type: torch's DeviceType (0 CPU, 1 CUDA). */
static PyObject *views_shim(int aten_type, int dev_id, PyObject *items) {
  Py_ssize_t n = PyList_Size(items);
  PyObject *caps = PyList_New(n), *out;
  if (caps == NULL)
    return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned long long data;
    unsigned char code, bits;
    PyObject *shape, *strides, *owner, *cap;
    int64_t dims[2 * MAX_SHIM_DIMS];
    void *h = NULL;
    if (!PyArg_ParseTuple(PyList_GetItem(items, i), "K(bb)OOO", &data, &code, &bits, &shape, &strides, &owner))
      goto fail;
    Py_ssize_t ndim = PyTuple_Check(shape) ? PyTuple_Size(shape) : -1;
    if (ndim < 0 || ndim > MAX_SHIM_DIMS) { /* shim_fits saw it otherwise: changed since */
      PyErr_SetString(PyExc_ValueError, "gpupool._fast.views: an item changed while it was read");
      goto fail;
    }
    if (read_dims(shape, ndim, dims, "shape") < 0 || read_dims(strides, ndim, dims + ndim, "strides") < 0)
      goto fail;
    Py_INCREF(owner);
    atomic_fetch_add(&live_exports, 1);
    if (g_from_blob((void *)(uintptr_t)data, ndim, dims, dims + ndim, 0, scalar_of(code, bits), aten_type, dev_id,
                    &h, 0 /* strided */, NULL, 0, blob_delete, owner) != 0 ||
        h == NULL) {
      /* torch kept no deleter: the owner is still ours */
      atomic_fetch_sub(&live_exports, 1);
      Py_DECREF(owner);
      PyErr_Format(PyExc_RuntimeError, "gpupool._fast.views: torch_from_blob refused the memory at 0x%llx "
                   "(device type %d, index %d)", data, aten_type, dev_id);
      goto fail;
    }
    cap = PyCapsule_New(h, NULL, NULL);
    if (cap == NULL) {
      g_delete_handle(h);
      goto fail;
    }
    PyList_SetItem(caps, i, cap);
    continue;
  fail:
    drop_handles(caps, i);
    Py_DECREF(caps);
    return NULL;
  }
  /* pybind converts the whole list before it takes any handle: a failure here left them all */
  out = PyObject_CallFunctionObjArgs(g_wrap_handles, caps, NULL);
  if (out == NULL)
    drop_handles(caps, n);
  Py_DECREF(caps);
  return out;
}

/* views() of a list of items, for fast_views and storages_of. */
static PyObject *views_of(PyObject *from_dlpack, int dev_type, int dev_id, PyObject *items) {
  /* DLPack's kDLCPU (1) and kDLCUDA (2) are torch's CPU (0) and CUDA (1) */
  if (g_from_blob != NULL && (dev_type == 1 || dev_type == 2)) {
    int fits = shim_fits(items);
    if (fits < 0)
      return NULL;
    if (fits) /* a CPU tensor's device has no index */
      return views_shim(dev_type - 1, dev_type == 1 ? -1 : dev_id, items);
  }
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

static PyObject *fast_views(PyObject *self, PyObject *args) {
  PyObject *from_dlpack, *items;
  int dev_type, dev_id;
  (void)self;
  if (!PyArg_ParseTuple(args, "OiiO!", &from_dlpack, &dev_type, &dev_id, &PyList_Type, &items))
    return NULL;
  return views_of(from_dlpack, dev_type, dev_id, items);
}

static PyObject *fast_live(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong(atomic_load(&live_exports));
}

static PyObject *set_four(PyObject *args, PyObject **slot[4]);

/* --- a received message's storages (_torch_recv._storages_of) ------------------------------ */
/* What storages_of needs, given once by setup_recv(): torch's weak storage references
 * (UntypedStorage._expired, _new_with_weak_ptr, _free_weak_ref: a reference is the int
 * _weak_ref() returns, one weak count each), the function views() falls back to
 * (torch.from_dlpack), and gpupool's memory kinds of device and pinned host-NUMA memory. */
static PyObject *g_expired, *g_new_weak, *g_free_weak, *g_recv_from_dlpack;
static long g_mem_device = -1, g_mem_host_numa = -1;

static PyObject *fast_setup_recv(PyObject *self, PyObject *args) {
  PyObject **slot[4] = {&g_expired, &g_new_weak, &g_free_weak, &g_recv_from_dlpack};
  PyObject *four;
  long dev, numa;
  (void)self;
  if (!PyArg_ParseTuple(args, "O!ll", &PyTuple_Type, &four, &dev, &numa))
    return NULL;
  PyObject *r = set_four(four, slot);
  if (r != NULL) {
    g_mem_device = dev;
    g_mem_host_numa = numa;
  }
  return r;
}

/* obj.name as a C long; -1 with an error set on failure. */
static long attr_long(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL)
    return -1;
  long r = PyLong_AsLong(v);
  Py_DECREF(v);
  return r;
}

/* The DLPack device of a hold (_Hold.dl_device): kDLCUDA and its device, kDLCUDAHost for
 * pinned host-NUMA memory, kDLCPU for the rest. 0 or -1 on an error. */
static int hold_device(PyObject *h, int *type, int *id) {
  long kind = attr_long(h, S_kind);
  if (kind == -1 && PyErr_Occurred())
    return -1;
  *id = 0;
  if (kind == g_mem_device) {
    long d = attr_long(h, S_device);
    if (d == -1 && PyErr_Occurred())
      return -1;
    *type = 2;
    *id = (int)d;
  } else {
    *type = kind == g_mem_host_numa ? 3 : 1;
  }
  return 0;
}

/* Per storage of a message, what storages_of keeps while it works (new references). */
typedef struct {
  PyObject *hold, *key, *ref, *ptr; /* ref: the entry found in received, or NULL */
  int dev_type, dev_id, as_view, done;
  int fresh; /* a new storage (not this process's storage of memory received before) */
} recv_slot;

/* _torch_recv._remember_many_locked for one storage: owned[ptr] = (weakref(hold), off),
 * unless owned names another live hold of that memory (it lives longer: it stays). */
static int remember(PyObject *owned, PyObject *ptr, PyObject *hold, PyObject *off) {
  PyObject *old = PyDict_GetItemWithError(owned, ptr); /* borrowed */
  if (old == NULL && PyErr_Occurred())
    return -1;
  if (old != NULL && PyTuple_Check(old) && PyTuple_Size(old) == 2) {
    PyObject *oh = PyObject_CallFunctionObjArgs(PyTuple_GetItem(old, 0), NULL);
    if (oh == NULL)
      return -1;
    int keep = 0;
    if (oh != Py_None && oh != hold) {
      PyObject *buf = PyObject_GetAttr(oh, S_buf); /* _Hold.released: buf is None */
      keep = buf == NULL ? -1 : buf != Py_None;
      Py_XDECREF(buf);
    }
    Py_DECREF(oh);
    if (keep)
      return keep < 0 ? -1 : 0;
  }
  PyObject *wr = PyWeakref_NewRef(hold, NULL);
  PyObject *v = wr != NULL ? PyTuple_Pack(2, wr, off) : NULL;
  Py_XDECREF(wr);
  int rc = v != NULL ? PyDict_SetItem(owned, ptr, v) : -1;
  Py_XDECREF(v);
  return rc;
}

/* One group of a message's new storages, those of one device made the same way (as the
 * sender's one tensor on the storage, or as bytes), starting at slot first: their views
 * made in one call, each slot's storage set (and made[i] for a tensor made whole). */
static int make_group(recv_slot *sl, Py_ssize_t n, Py_ssize_t first, PyObject *sizes,
                      PyObject *whole, PyObject *storages, PyObject *made) {
  static PyObject *byte_type;
  int rc = -1, type = sl[first].dev_type, id = sl[first].dev_id, as_view = sl[first].as_view;
  PyObject *items = PyList_New(0), *ts = NULL;
  if (items == NULL)
    return -1;
  if (byte_type == NULL && (byte_type = Py_BuildValue("(ii)", 1, 8)) == NULL) /* DLPack's uint8 */
    goto out;
  for (Py_ssize_t i = first; i < n; i++) {
    recv_slot *s = &sl[i];
    if (s->done || s->dev_type != type || s->dev_id != id || s->as_view != as_view)
      continue;
    PyObject *item;
    if (as_view) {
      PyObject *w = PyList_GetItem(whole, i);
      if (!PyTuple_Check(w) || PyTuple_Size(w) != 3) {
        PyErr_SetString(PyExc_ValueError, "gpupool._fast.storages_of: whole[i] must be (type, shape, strides)");
        goto out;
      }
      item = PyTuple_Pack(5, s->ptr, PyTuple_GetItem(w, 0), PyTuple_GetItem(w, 1), PyTuple_GetItem(w, 2), s->hold);
    } else {
      item = Py_BuildValue("(OO(O)(i)O)", s->ptr, byte_type, PyList_GetItem(sizes, i), 1, s->hold);
    }
    if (item == NULL || PyList_Append(items, item) < 0) {
      Py_XDECREF(item);
      goto out;
    }
    Py_DECREF(item);
  }
  if ((ts = views_of(g_recv_from_dlpack, type, id, items)) == NULL)
    goto out;
  Py_ssize_t k = 0;
  for (Py_ssize_t i = first; i < n; i++) {
    recv_slot *s = &sl[i];
    if (s->done || s->dev_type != type || s->dev_id != id || s->as_view != as_view)
      continue;
    PyObject *t = PyList_GetItem(ts, k++);
    PyObject *st = t != NULL ? PyObject_CallMethodObjArgs(t, S_untyped_storage, NULL) : NULL;
    if (st == NULL)
      goto out;
    PyList_SetItem(storages, i, st);
    s->done = 1;
    if (as_view) {
      PyObject *key = PyLong_FromSsize_t(i);
      int r = key != NULL ? PyDict_SetItem(made, key, t) : -1;
      Py_XDECREF(key);
      if (r < 0)
        goto out;
    }
  }
  rc = 0;
out:
  Py_XDECREF(ts);
  Py_DECREF(items);
  return rc;
}

/* storages_of(holds, offs, sizes, whole, received, owned): _torch_recv._storages_of in C (its
 * docstring says what it does), with its caller holding the lock of received and owned. */
static PyObject *fast_storages_of(PyObject *self, PyObject *args) {
  PyObject *holds, *offs, *sizes, *whole, *received, *owned, *storages = NULL, *made = NULL, *res = NULL;
  recv_slot *sl = NULL;
  Py_ssize_t n = 0;
  (void)self;
  if (!PyArg_ParseTuple(args, "O!O!O!OO!O!", &PyList_Type, &holds, &PyList_Type, &offs, &PyList_Type, &sizes,
                        &whole, &PyDict_Type, &received, &PyDict_Type, &owned))
    return NULL;
  if (g_expired == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "gpupool._fast.storages_of called before setup_recv()");
    return NULL;
  }
  n = PyList_Size(holds);
  if (PyList_Size(offs) != n || PyList_Size(sizes) != n ||
      (whole != Py_None && (!PyList_Check(whole) || PyList_Size(whole) != n))) {
    PyErr_SetString(PyExc_ValueError, "gpupool._fast.storages_of: holds, offs, sizes (and whole) differ in length");
    return NULL;
  }
  if ((sl = calloc(n ? (size_t)n : 1, sizeof(*sl))) == NULL)
    return PyErr_NoMemory();
  if ((storages = PyList_New(n)) == NULL || (made = PyDict_New()) == NULL)
    goto out;
  for (Py_ssize_t i = 0; i < n; i++) {
    Py_INCREF(Py_None);
    PyList_SetItem(storages, i, Py_None);
  }
  /* This process's storage of memory received before, where it is still alive. */
  for (Py_ssize_t i = 0; i < n; i++) {
    recv_slot *s = &sl[i];
    PyObject *off = PyList_GetItem(offs, i);
    s->hold = PyList_GetItem(holds, i);
    Py_INCREF(s->hold);
    PyObject *bid = PyObject_GetAttr(s->hold, S_buffer_id);
    if (bid == NULL)
      goto out;
    s->key = PyTuple_Pack(3, bid, off, PyList_GetItem(sizes, i));
    Py_DECREF(bid);
    if (s->key == NULL)
      goto out;
    PyObject *ref = PyDict_GetItemWithError(received, s->key);
    if (ref == NULL && PyErr_Occurred())
      goto out;
    if (ref != NULL) {
      Py_INCREF(ref);
      s->ref = ref;
      PyObject *e = PyObject_CallFunctionObjArgs(g_expired, ref, NULL);
      int gone = e != NULL ? PyObject_IsTrue(e) : -1;
      Py_XDECREF(e);
      if (gone < 0)
        goto out;
      if (!gone) {
        PyObject *st = PyObject_CallFunctionObjArgs(g_new_weak, ref, NULL);
        if (st == NULL)
          goto out;
        if (st != Py_None) {
          /* The hold goes with its last reference (other storages may share it). */
          PyList_SetItem(storages, i, st);
          Py_INCREF(Py_None);
          PyList_SetItem(holds, i, Py_None);
          s->done = 1;
          continue;
        }
        Py_DECREF(st);
      }
    }
    s->fresh = 1;
    PyObject *base = PyObject_GetAttr(s->hold, S_ptr);
    if (base == NULL)
      goto out;
    s->ptr = PyNumber_Add(base, off);
    Py_DECREF(base);
    if (s->ptr == NULL || hold_device(s->hold, &s->dev_type, &s->dev_id) < 0)
      goto out;
    if (whole != Py_None) {
      int w = PyObject_IsTrue(PyList_GetItem(whole, i));
      if (w < 0)
        goto out;
      s->as_view = w;
    }
  }
  /* The new storages, a views() call per device and way; their deleters drop the holds. */
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!sl[i].done && make_group(sl, n, i, sizes, whole, storages, made) < 0)
      goto out;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!sl[i].fresh)
      continue;
    Py_INCREF(Py_None);
    PyList_SetItem(holds, i, Py_None);
  }
  /* Known from here on: received[key] a weak reference to the new storage (an entry's old
   * one let go), owned[data pointer] the hold it is shared on by. */
  for (Py_ssize_t i = 0; i < n; i++) {
    recv_slot *s = &sl[i];
    if (!s->fresh)
      continue;
    PyObject *w = PyObject_CallMethodObjArgs(PyList_GetItem(storages, i), S__weak_ref, NULL);
    if (w == NULL)
      goto out;
    PyObject *old = PyDict_GetItemWithError(received, s->key);
    Py_XINCREF(old);
    int r = old == NULL && PyErr_Occurred() ? -1 : PyDict_SetItem(received, s->key, w);
    Py_DECREF(w);
    if (r == 0 && old != NULL) {
      PyObject *x = PyObject_CallFunctionObjArgs(g_free_weak, old, NULL);
      r = x == NULL ? -1 : 0;
      Py_XDECREF(x);
    }
    Py_XDECREF(old);
    if (r < 0 || remember(owned, s->ptr, s->hold, PyList_GetItem(offs, i)) < 0)
      goto out;
  }
  res = PyTuple_Pack(2, storages, made);
out:
  for (Py_ssize_t i = 0; i < n; i++) {
    Py_XDECREF(sl[i].hold);
    Py_XDECREF(sl[i].key);
    Py_XDECREF(sl[i].ref);
    Py_XDECREF(sl[i].ptr);
  }
  free(sl);
  Py_XDECREF(storages);
  Py_XDECREF(made);
  return res;
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

/* Whether t, a tensor made whole from memory, is the one the sender described. It was made
 * from the sender's own note of that tensor (_Batch.whole: its element type, shape and
 * strides), so its shape and strides are the described ones by construction; the offset and
 * the element type (several torch types could share a DLPack one) are checked. */
static int is_as_described(PyObject *t, PyObject *dtype, PyObject *offset) {
  int eq = PyObject_RichCompareBool(offset, g_zero, Py_EQ);
  if (eq != 1)
    return eq;
  PyObject *td = PyObject_GetAttr(t, S_dtype);
  if (td == NULL)
    return -1;
  eq = PyObject_RichCompareBool(td, dtype, Py_EQ);
  Py_DECREF(td);
  return eq;
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
    int ok = is_as_described(t, dtype, offset);
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

/* What batch_add needs, given by setup_batch(): _torch_send._Batch (a subclass, or another
 * class, gets its own add() called) and torch dtype -> DLPack (code, bits). */
static PyObject *g_batch_type, *g_dl_types;

static PyObject *fast_setup_batch(PyObject *self, PyObject *args) {
  PyObject *type, *types, *old_type = g_batch_type, *old_types = g_dl_types;
  (void)self;
  if (!PyArg_ParseTuple(args, "OO!", &type, &PyDict_Type, &types))
    return NULL;
  Py_INCREF(type);
  Py_INCREF(types);
  g_batch_type = type;
  g_dl_types = types;
  Py_XDECREF(old_type);
  Py_XDECREF(old_types);
  Py_RETURN_NONE;
}

/* The (code, bits), shape and strides under which the receiver may make the tensor straight
 * from the storage's memory (_Batch.whole): a new reference to that tuple when the tensor
 * covers its storage of nbytes whole (offset 0, dense, a type DLPack names), else None. */
static PyObject *whole_of(PyObject *dtype, PyObject *offset, PyObject *size, PyObject *stride, long long nbytes) {
  PyObject *dl = PyDict_GetItem(g_dl_types, dtype); /* borrowed */
  long long z = PyLong_AsLongLong(offset), bits, numel = 1, expect = 1;
  Py_ssize_t nd = PyTuple_Size(size);
  if (z != 0 || dl == NULL || !PyTuple_Check(dl) || PyTuple_Size(dl) != 2 || PyTuple_Size(stride) != nd) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  bits = PyLong_AsLongLong(PyTuple_GetItem(dl, 1));
  for (Py_ssize_t d = nd - 1; d >= 0; d--) {
    long long n = PyLong_AsLongLong(PyTuple_GetItem(size, d));
    long long st = PyLong_AsLongLong(PyTuple_GetItem(stride, d));
    if (n != 1 && st != expect) /* torch's is_contiguous: a dimension of one has any stride */
      Py_RETURN_NONE;
    expect *= n;
    numel *= n;
  }
  if (PyErr_Occurred() || numel * (bits / 8) != nbytes || bits % 8) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyTuple_Pack(3, dl, size, stride);
}

/* _torch_send._Batch.add(storage, device, tensor) in C, for the reducer, which read the
 * storage's size (nb) and the device's type and index (dev_type, didx; cuda: whether it is
 * a CUDA device) already: the storage's place
 * among the message's (a new reference to it), the storage added if new; views[i] is what
 * whole_of says of the tensor, or None once a second tensor has the storage. */
static PyObject *batch_add(PyObject *batch, PyObject *st, PyObject *nb, PyObject *didx, PyObject *dev_type,
                           int cuda, PyObject *dtype, PyObject *offset, PyObject *size, PyObject *stride) {
  PyObject *ptr = NULL, *key = NULL, *index = NULL, *res = NULL;
  PyObject *lists[5] = {NULL, NULL, NULL, NULL, NULL}, *vals[5] = {NULL, NULL, NULL, NULL, NULL};
  PyObject *const names[5] = {S_storages, S_ptrs, S_sizes, S_devs, S_views};
  if ((ptr = PyObject_CallMethodObjArgs(st, S_data_ptr, NULL)) == NULL ||
      (key = PyTuple_Pack(4, dev_type, didx, ptr, nb)) == NULL || (index = PyObject_GetAttr(batch, S_index)) == NULL)
    goto out;
  for (int k = 0; k < 5; k++)
    if ((lists[k] = PyObject_GetAttr(batch, names[k])) == NULL || !PyList_Check(lists[k])) {
      if (lists[k] != NULL)
        PyErr_SetString(PyExc_TypeError, "gpupool._fast: a _Batch's lists are not lists");
      goto out;
    }
  res = PyDict_GetItemWithError(index, key); /* borrowed */
  if (res != NULL) {
    Py_INCREF(res);
    Py_ssize_t i = PyLong_AsSsize_t(res);
    if (i < 0 || i >= PyList_Size(lists[4])) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_IndexError, "gpupool._fast: a _Batch's place out of range");
      Py_CLEAR(res);
      goto out;
    }
    Py_INCREF(Py_None);
    PyList_SetItem(lists[4], i, Py_None); /* two tensors on it: none is made whole */
    goto out;
  }
  if (PyErr_Occurred())
    goto out;
  long long nbytes = PyLong_AsLongLong(nb);
  if (nbytes == -1 && PyErr_Occurred())
    goto out;
  Py_INCREF(st);
  vals[0] = st;
  Py_INCREF(ptr);
  vals[1] = ptr;
  Py_INCREF(nb);
  vals[2] = nb;
  vals[3] = cuda ? (Py_INCREF(didx), didx) : PyLong_FromLong(-1);
  vals[4] = whole_of(dtype, offset, size, stride, nbytes);
  if (vals[3] == NULL || vals[4] == NULL || (res = PyLong_FromSsize_t(PyList_Size(lists[0]))) == NULL)
    goto out;
  if (PyDict_SetItem(index, key, res) < 0) {
    Py_CLEAR(res);
    goto out;
  }
  for (int k = 0; k < 5; k++)
    if (PyList_Append(lists[k], vals[k]) < 0) { /* out of memory: the lists disagree, the message fails */
      Py_CLEAR(res);
      goto out;
    }
out:
  for (int k = 0; k < 5; k++) {
    Py_XDECREF(lists[k]);
    Py_XDECREF(vals[k]);
  }
  Py_XDECREF(index);
  Py_XDECREF(key);
  Py_XDECREF(ptr);
  return res;
}

/* The common case of _torch_send._reduce_tensor, for which pickle calls this directly: a
 * strided tensor of a message being pickled (ForkingPickler.dump), on a device gpupool.torch
 * serves, that gpupool serves (asked at the message's first tensor), not a non-leaf requiring
 * grad, with a storage of some bytes. Anything else goes to the Python reducer as it is, so
 * that both paths decide the same. Returns 1 with *out set, 0 for "not the common case", -1 on
 * an error. */
static int reduce_common(PyObject *t, PyObject *batch, PyObject **out) {
  PyObject *dev = NULL, *st = NULL, *args = NULL, *v = NULL, *devt = NULL, *didx = NULL, *nb = NULL;
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
  int cuda = attr_true(t, S_is_cuda);
  if (cuda < 0)
    return -1;
  if (!cuda) {
    /* CPU tensors only with install(cpu=True), which the message noted as it began */
    r = attr_true(t, S_is_cpu);
    if (r == 1)
      r = attr_true(batch, S_cpu);
    if (r != 1)
      return r;
  }
  /* The device as _Batch.add names it (device.type, device.index), without a torch.device
   * and its type string made per tensor (a fifth of this function's time). */
  devt = cuda ? S_cuda : S_cpu;
  Py_INCREF(devt);
  if (cuda) {
    didx = PyObject_CallMethodObjArgs(t, S_get_device, NULL);
    if (didx == NULL)
      goto out;
  } else {
    Py_INCREF(Py_None);
    didx = Py_None;
  }
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
  if (st == NULL || (nb = PyObject_CallMethodObjArgs(st, S_nbytes, NULL)) == NULL) {
    Py_DECREF(rg);
    goto out;
  }
  r = PyObject_IsTrue(nb);
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
  for (int k = 1; k < 5; k++) {
    PyObject *it;
    switch (k) {
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
  {
    PyObject *place;
    if (g_dl_types != NULL && (PyObject *)Py_TYPE(batch) == g_batch_type)
      place = batch_add(batch, st, nb, didx, devt, cuda, PyTuple_GetItem(args, 2), PyTuple_GetItem(args, 3),
                        PyTuple_GetItem(args, 4), PyTuple_GetItem(args, 5));
    else /* another class of message: its own add(storage, device, tensor) */
      place = (dev = PyObject_GetAttr(t, S_device)) != NULL ? PyObject_CallMethodObjArgs(batch, S_add, st, dev, t, NULL)
                                                            : NULL;
    if (place == NULL)
      goto out;
    PyTuple_SetItem(args, 1, place);
  }
  *out = PyTuple_Pack(2, g_rebuild, args);
  rc = *out != NULL ? 1 : -1;
out:
  Py_XDECREF(args);
  Py_XDECREF(v);
  Py_XDECREF(nb);
  Py_XDECREF(st);
  Py_XDECREF(devt);
  Py_XDECREF(didx);
  Py_XDECREF(dev);
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
  {"setup_batch", fast_setup_batch, METH_VARARGS,
   "setup_batch(batch_type, dl_types): reduce_tensor adds a tensor to a message of batch_type "
   "itself (_Batch.add in C), noting (code, bits), shape and strides of a tensor that covers "
   "its storage (dl_types: torch dtype -> DLPack (code, bits))."},
  {"setup_send", fast_setup_send, METH_VARARGS,
   "setup_send(tls, py_reduce, rebuild, strided): what reduce_tensor reads."},
  {"views", fast_views, METH_VARARGS,
   "views(from_dlpack, device_type, device_id, items): a tensor per (data, (code, bits), "
   "shape, strides, owner), a DLPack view keeping owner until torch lets go of it."},
  {"live", fast_live, METH_NOARGS, "live(): views whose deleter has not run yet."},
  {"setup_recv", fast_setup_recv, METH_VARARGS,
   "setup_recv((expired, new_with_weak_ptr, free_weak_ref, from_dlpack), mem_device, mem_host_numa): "
   "what storages_of calls (torch.UntypedStorage's weak reference functions, torch.from_dlpack) "
   "and gpupool's memory kinds."},
  {"storages_of", fast_storages_of, METH_VARARGS,
   "storages_of(holds, offs, sizes, whole, received, owned): (storages, made) of a received "
   "message, _torch_recv._storages_of in C; the caller holds the lock of received and owned."},
  {"setup_torch", fast_setup_torch, METH_VARARGS,
   "setup_torch(from_blob, delete_handle, wrap, types): torch's torch_from_blob and "
   "aoti_torch_delete_tensor_object (addresses), the function turning handles into tensors, "
   "and ((code, bits, scalar type), ...): views() then makes its tensors through them."},
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
