/* Tessera's launch fast path (tessera/runtime/fastcall.py builds and loads this module).
 *
 * A `Call` holds one bound call of a compiled function: what an earlier, fully validated call's
 * arguments were (type, dtype, shape, device and layout of each tensor, the value of each other
 * argument), what the call allocates, and each kernel launch with its parameter layout. Calling it
 * with new arguments checks each of them against that record and either returns None (something
 * differs: the caller takes Tessera's general path, which names what is wrong) or allocates the
 * outputs, encodes tensor maps, makes the device's primary context current and launches every step
 * with cuLaunchKernel / cuLaunchKernelEx called directly, never returning to Python in between.
 * Without a C compiler every call takes the general path (fastcall.py says why).
 *
 * The driver's entry points are looked up with dlsym in the library `configure` names (libcuda, or
 * a fake one in CPU tests), so the module itself needs no CUDA headers: the two launch structs below
 * mirror cuda.h's, which a CPU test checks with cuda.h's own offsets.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SLOT_BYTES 128 /* one param: a pointer or u32 in its first bytes, or a whole CUtensorMap */
#define MAX_ARGS 64
#define MAX_BUFFERS 128
#define MAX_MAPS 64
#define PROGRAMMATIC_STREAM_SERIALIZATION 6 /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */

typedef int CUresult;

typedef struct {
    int id;
    char pad[4];
    union { char bytes[64]; int programmaticStreamSerializationAllowed; } value;
} LaunchAttribute; /* CUlaunchAttribute */

typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void *hStream;
    LaunchAttribute *attrs;
    unsigned numAttrs;
} LaunchConfig; /* CUlaunchConfig */

static CUresult (*cuLaunchKernel_)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, void *, void **, void **);
static CUresult (*cuLaunchKernelEx_)(const LaunchConfig *, void *, void **, void **);
static CUresult (*cuCtxGetCurrent_)(void **);
static CUresult (*cuCtxSetCurrent_)(void *);
static PyObject *on_error; /* on_error(api, code, step): raises the driver's error for a failed call */

static PyObject *s_dtype, *s_shape, *s_requires_grad, *s_data_ptr, *s_is_contiguous, *s_stride, *s_get_device;

enum { ARG_TENSOR = 0, ARG_VALUE = 1 };
enum { GUARD_GLOBAL = 0, GUARD_CELL = 1 };
enum { PARAM_POINTER = 0, PARAM_U32 = 1, PARAM_TENSOR_MAP = 2 };

typedef struct {
    int kind;
    PyTypeObject *type;  /* a tensor's exact type, or a value's */
    PyObject *dtype;     /* compared by identity (torch dtypes are singletons) */
    PyObject *shape;     /* tuple */
    PyObject *strides;   /* tuple, or NULL: contiguous */
    long device;
    Py_ssize_t nbytes;   /* the bytes its elements span, for the overlap check of a kernel's outputs */
    PyObject *value;     /* ARG_VALUE: compared with == */
} ArgSpec;

typedef struct {
    int kind;
    Py_ssize_t buffer;   /* PARAM_POINTER / PARAM_TENSOR_MAP: index into inputs + allocations */
    uint32_t value;      /* PARAM_U32 */
    PyObject *spec;      /* PARAM_TENSOR_MAP: passed to encode(pointer, spec) */
    uint64_t last_ptr;   /* PARAM_TENSOR_MAP: the last map encoded, over this pointer (a caching */
    PyObject *last_map;  /* allocator hands a steady loop the same addresses: no Python call then) */
} Param;

typedef struct {
    void *function;
    unsigned grid[3], block[3], shared;
    int programmatic;
    Py_ssize_t n_params;
    Param *params;
    unsigned char *storage;  /* n_params slots of SLOT_BYTES */
    void **pointers;         /* kernelParams: each slot's address */
} StepSpec;

typedef struct {
    /* callable(*args, **dict(zip(kwnames, kwvalues))), with the call's argument `template` first
     * where template >= 0 (torch.empty_like(x)) */
    PyObject *callable, *args, *kwnames, *kwvalues;
    Py_ssize_t template;
} Alloc;

typedef struct {
    int kind;            /* GUARD_GLOBAL: container is a module's dict; GUARD_CELL: a closure cell */
    PyObject *container, *name, *value;
    int present;         /* 0: the variable must be absent (unassigned, deleted) */
} Guard;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_args, n_inputs, n_allocs, n_results, n_steps, n_maps, n_guards;
    Guard *guards;           /* the globals and closure variables the trace read, each the same object */
    Py_ssize_t n_disjoint, *disjoint;  /* a kernel's output arguments, which may overlap no other argument */
    ArgSpec *args;
    Py_ssize_t *inputs;      /* each program input's argument position */
    Alloc *allocs;
    StepSpec *steps;
    PyObject *stream, *stream_arg, *encode;
    void *context;
    PyObject *record;        /* keeps every object above alive */
} CallObject;

static void free_steps(CallObject *self) {
    for (Py_ssize_t i = 0; self->steps && i < self->n_steps; i++) {
        for (Py_ssize_t j = 0; self->steps[i].params && j < self->steps[i].n_params; j++)
            Py_XDECREF(self->steps[i].params[j].last_map);
        PyMem_Free(self->steps[i].params);
        free(self->steps[i].storage);
        PyMem_Free(self->steps[i].pointers);
    }
    PyMem_Free(self->steps);
}

static void Call_dealloc(CallObject *self) {
    PyMem_Free(self->args);
    PyMem_Free(self->guards);
    PyMem_Free(self->disjoint);
    PyMem_Free(self->inputs);
    PyMem_Free(self->allocs);
    free_steps(self);
    Py_XDECREF(self->record);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* n zeroed items of `size` bytes (at least one item), or NULL with MemoryError. */
static void *zeroed(Py_ssize_t n, size_t size) {
    void *p = PyMem_Calloc(n ? (size_t)n : 1, size);
    if (!p) PyErr_NoMemory();
    return p;
}

static int as_uint(PyObject *o, unsigned *out) {
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    *out = (unsigned)v;
    return 0;
}

static void *as_pointer(PyObject *o) {
    return (void *)(uintptr_t)PyLong_AsUnsignedLongLong(o);
}

/* Call(record): record = (args, inputs, allocs, n_results, (stream, stream_arg), context, encode, steps
 * [, guards, disjoint, owner]), as fastcall.py's `Record.as_tuple` lays it out. */
static int Call_init(CallObject *self, PyObject *a, PyObject *kw) {
    PyObject *record, *args, *inputs, *allocs, *stream, *steps, *guards = NULL, *disjoint = NULL, *owner = NULL;
    Py_ssize_t n_results;
    PyObject *context, *encode;
    if (!PyArg_ParseTuple(a, "O!", &PyTuple_Type, &record)) return -1;
    if (self->record) {
        PyErr_SetString(PyExc_TypeError, "fastcall: a Call is initialized once");
        return -1;
    }
    if (!PyArg_ParseTuple(record, "O!O!O!nO!OOO!|O!O!O", &PyTuple_Type, &args, &PyTuple_Type, &inputs,
                          &PyTuple_Type, &allocs, &n_results, &PyTuple_Type, &stream, &context, &encode,
                          &PyTuple_Type, &steps, &PyTuple_Type, &guards, &PyTuple_Type, &disjoint, &owner))
        return -1;   /* (owner: kept alive with the record, unread) */
    Py_INCREF(record);
    self->record = record;
    self->n_args = PyTuple_GET_SIZE(args);
    self->n_inputs = PyTuple_GET_SIZE(inputs);
    self->n_allocs = PyTuple_GET_SIZE(allocs);
    self->n_results = n_results;
    if (self->n_args > MAX_ARGS || self->n_inputs + self->n_allocs > MAX_BUFFERS || n_results > self->n_allocs) {
        PyErr_SetString(PyExc_ValueError, "fastcall: too many arguments or buffers");
        return -1;
    }
    if (!PyArg_ParseTuple(stream, "OO", &self->stream, &self->stream_arg)) return -1;
    self->context = as_pointer(context);
    self->encode = encode;
    if (PyErr_Occurred()) return -1;

    if (!(self->args = zeroed(self->n_args, sizeof(ArgSpec)))) return -1;
    for (Py_ssize_t i = 0; i < self->n_args; i++) {
        ArgSpec *s = &self->args[i];
        PyObject *strides, *spec = PyTuple_GET_ITEM(args, i);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 1) {
            PyErr_SetString(PyExc_ValueError, "fastcall: an argument's spec is a tuple");
            return -1;
        }
        s->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
        if (s->kind == ARG_VALUE) {
            if (!PyArg_ParseTuple(spec, "iO", &s->kind, &s->value)) return -1;
            s->type = Py_TYPE(s->value);
        } else if (s->kind == ARG_TENSOR) {
            if (!PyArg_ParseTuple(spec, "iO!OO!lOn", &s->kind, &PyType_Type, &s->type, &s->dtype,
                                  &PyTuple_Type, &s->shape, &s->device, &strides, &s->nbytes))
                return -1;
            if (strides != Py_None && !PyTuple_Check(strides)) {
                PyErr_SetString(PyExc_ValueError, "fastcall: strides are a tuple or None");
                return -1;
            }
            s->strides = strides == Py_None ? NULL : strides;
        } else {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fastcall: an argument is a tensor or a value");
            return -1;
        }
    }
    self->n_guards = guards ? PyTuple_GET_SIZE(guards) : 0;
    if (!(self->guards = zeroed(self->n_guards, sizeof(Guard)))) return -1;
    for (Py_ssize_t i = 0; i < self->n_guards; i++) {
        Guard *g = &self->guards[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(guards, i), "iOOOp", &g->kind, &g->container, &g->name, &g->value,
                              &g->present))
            return -1;
        if (g->kind == GUARD_GLOBAL ? !PyDict_Check(g->container) || !PyUnicode_Check(g->name)
                                    : g->kind != GUARD_CELL || !PyCell_Check(g->container)) {
            PyErr_SetString(PyExc_ValueError, "fastcall: a bad guard");
            return -1;
        }
    }
    self->n_disjoint = disjoint ? PyTuple_GET_SIZE(disjoint) : 0;
    if (!(self->disjoint = zeroed(self->n_disjoint, sizeof(Py_ssize_t)))) return -1;
    for (Py_ssize_t i = 0; i < self->n_disjoint; i++) {
        self->disjoint[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(disjoint, i));
        if (self->disjoint[i] < 0 || self->disjoint[i] >= self->n_args ||
            self->args[self->disjoint[i]].kind != ARG_TENSOR) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fastcall: a disjoint argument is no tensor");
            return -1;
        }
    }
    if (!(self->inputs = zeroed(self->n_inputs, sizeof(Py_ssize_t)))) return -1;
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        self->inputs[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(inputs, i));
        if (self->inputs[i] < 0 || self->inputs[i] >= self->n_args) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fastcall: input position out of range");
            return -1;
        }
    }
    if (!(self->allocs = zeroed(self->n_allocs, sizeof(Alloc)))) return -1;
    for (Py_ssize_t i = 0; i < self->n_allocs; i++) {
        Alloc *al = &self->allocs[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(allocs, i), "OnO!O!O!", &al->callable, &al->template,
                              &PyTuple_Type, &al->args, &PyTuple_Type, &al->kwnames, &PyTuple_Type, &al->kwvalues))
            return -1;
        if (PyTuple_GET_SIZE(al->args) + PyTuple_GET_SIZE(al->kwvalues) > 7 || al->template >= self->n_args ||
            PyTuple_GET_SIZE(al->kwnames) != PyTuple_GET_SIZE(al->kwvalues)) {
            PyErr_SetString(PyExc_ValueError, "fastcall: a bad allocation");
            return -1;
        }
    }
    self->n_steps = PyTuple_GET_SIZE(steps);
    if (!(self->steps = zeroed(self->n_steps, sizeof(StepSpec)))) return -1;
    Py_ssize_t n_buffers = self->n_inputs + self->n_allocs;
    for (Py_ssize_t i = 0; i < self->n_steps; i++) {
        StepSpec *st = &self->steps[i];
        PyObject *handle, *params;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(steps, i), "O(III)(III)IpO!", &handle, &st->grid[0], &st->grid[1],
                              &st->grid[2], &st->block[0], &st->block[1], &st->block[2], &st->shared,
                              &st->programmatic, &PyTuple_Type, &params))
            return -1;
        st->function = as_pointer(handle);
        if (PyErr_Occurred()) return -1;
        st->n_params = PyTuple_GET_SIZE(params);
        st->params = PyMem_Calloc(st->n_params ? st->n_params : 1, sizeof(Param));
        st->pointers = PyMem_Calloc(st->n_params ? st->n_params : 1, sizeof(void *));
        st->storage = aligned_alloc(64, (st->n_params ? st->n_params : 1) * SLOT_BYTES);
        if (!st->params || !st->pointers || !st->storage) {
            PyErr_NoMemory();
            return -1;
        }
        memset(st->storage, 0, (st->n_params ? st->n_params : 1) * SLOT_BYTES);
        for (Py_ssize_t j = 0; j < st->n_params; j++) {
            Param *p = &st->params[j];
            PyObject *x;
            st->pointers[j] = st->storage + j * SLOT_BYTES;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(params, j), "iO|O", &p->kind, &x, &p->spec)) return -1;
            if (p->kind != PARAM_POINTER && p->kind != PARAM_U32 && p->kind != PARAM_TENSOR_MAP) {
                PyErr_SetString(PyExc_ValueError, "fastcall: bad parameter kind");
                return -1;
            }
            if (p->kind == PARAM_U32) {
                if (as_uint(x, &p->value) < 0) return -1;
            } else {
                p->buffer = PyLong_AsSsize_t(x);
                if (p->buffer < 0 || p->buffer >= n_buffers || (p->kind == PARAM_TENSOR_MAP && !p->spec)) {
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "fastcall: bad parameter");
                    return -1;
                }
                self->n_maps += p->kind == PARAM_TENSOR_MAP;
            }
        }
    }
    if (self->n_maps > MAX_MAPS) {
        PyErr_SetString(PyExc_ValueError, "fastcall: too many tensor maps");
        return -1;
    }
    return 0;
}

/* 1 when every guarded variable holds the object it held when the record was made, else 0; -1
 * with an exception. */
static int guards_hold(const CallObject *self) {
    for (Py_ssize_t i = 0; i < self->n_guards; i++) {
        const Guard *g = &self->guards[i];
        PyObject *now;
        if (g->kind == GUARD_GLOBAL) {
            now = PyDict_GetItemWithError(g->container, g->name);   /* borrowed */
            if (!now && PyErr_Occurred()) return -1;
        } else {
            now = PyCell_GET(g->container);
        }
        if (g->present ? now != g->value : now != NULL) return 0;
    }
    return 1;
}

/* Whether a call's non-tensor argument is the record's (of its type): floats by their bits, as
   the compile keys them (captures.exact: -0.0 is not 0.0, a NaN is itself), the rest by ==. */
static int same_value(PyObject *x, PyObject *value) {
    if (PyFloat_Check(x)) {
        double a = PyFloat_AS_DOUBLE(x), b = PyFloat_AS_DOUBLE(value);
        return memcmp(&a, &b, sizeof a) == 0;
    }
    return PyObject_RichCompareBool(x, value, Py_EQ);
}

/* 1 when x is the tensor `s` describes, 0 when not, -1 with an exception; *ptr gets its address. */
static int tensor_matches(const ArgSpec *s, PyObject *x, uint64_t *ptr) {
    PyObject *o;
    int ok;
    if (Py_TYPE(x) != s->type) return 0;
    if (!(o = PyObject_GetAttr(x, s_requires_grad))) return -1;
    ok = o == Py_False;
    Py_DECREF(o);
    if (!ok) return 0;
    if (!(o = PyObject_GetAttr(x, s_dtype))) return -1;
    ok = o == s->dtype;
    Py_DECREF(o);
    if (!ok) return 0;
    if (!(o = PyObject_GetAttr(x, s_shape))) return -1;
    ok = PyObject_RichCompareBool(o, s->shape, Py_EQ);
    Py_DECREF(o);
    if (ok != 1) return ok;
    if (!(o = PyObject_CallMethodNoArgs(x, s_get_device))) return -1;
    ok = PyLong_AsLong(o) == s->device;
    Py_DECREF(o);
    if (!ok) return PyErr_Occurred() ? -1 : 0;
    if (s->strides) {
        if (!(o = PyObject_CallMethodNoArgs(x, s_stride))) return -1;
        ok = PyObject_RichCompareBool(o, s->strides, Py_EQ);
    } else {
        if (!(o = PyObject_CallMethodNoArgs(x, s_is_contiguous))) return -1;
        ok = o == Py_True;
    }
    Py_DECREF(o);
    if (ok != 1) return ok;
    if (!(o = PyObject_CallMethodNoArgs(x, s_data_ptr))) return -1;
    *ptr = PyLong_AsUnsignedLongLong(o);
    Py_DECREF(o);
    if (PyErr_Occurred()) return -1;
    return *ptr % 16 == 0;
}

static PyObject *allocate(const Alloc *al, PyObject *call_args, uint64_t *ptr) {
    PyObject *stack[8];
    Py_ssize_t n = 0, k = PyTuple_GET_SIZE(al->kwvalues);
    if (al->template >= 0) stack[n++] = PyTuple_GET_ITEM(call_args, al->template);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(al->args); i++) stack[n++] = PyTuple_GET_ITEM(al->args, i);
    for (Py_ssize_t i = 0; i < k; i++) stack[n + i] = PyTuple_GET_ITEM(al->kwvalues, i);
    PyObject *t = PyObject_Vectorcall(al->callable, stack, n, k ? al->kwnames : NULL);
    if (!t) return NULL;
    PyObject *o = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!o) {
        Py_DECREF(t);
        return NULL;
    }
    *ptr = PyLong_AsUnsignedLongLong(o);
    Py_DECREF(o);
    if (PyErr_Occurred()) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

static PyObject *launch_failed(const char *api, CUresult code, Py_ssize_t step) {
    PyObject *r = PyObject_CallFunction(on_error, "sin", api, (int)code, step);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%s failed with CUresult %d", api, (int)code);
    return NULL;
}

/* The launches: after every Python call of this call is done, so that no other thread (which may
 * run during one) can rewrite the parameter slots between their filling and their launch. */
static PyObject *launch_all(CallObject *self, const uint64_t *buffers, PyObject **maps, void *stream) {
    void *current = NULL;
    CUresult r = cuCtxGetCurrent_(&current);
    if (r) return launch_failed("cuCtxGetCurrent", r, -1);
    if (current != self->context && (r = cuCtxSetCurrent_(self->context)))
        return launch_failed("cuCtxSetCurrent", r, -1);
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < self->n_steps; i++) {
        StepSpec *st = &self->steps[i];
        for (Py_ssize_t j = 0; j < st->n_params; j++) {
            const Param *p = &st->params[j];
            unsigned char *slot = st->storage + j * SLOT_BYTES;
            if (p->kind == PARAM_POINTER) {
                memcpy(slot, &buffers[p->buffer], sizeof(uint64_t));
            } else if (p->kind == PARAM_U32) {
                memcpy(slot, &p->value, sizeof(uint32_t));
            } else {
                memcpy(slot, PyBytes_AS_STRING(maps[m]), SLOT_BYTES);
                m++;
            }
        }
        if (st->programmatic) {
            LaunchAttribute attribute;
            memset(&attribute, 0, sizeof attribute);
            attribute.id = PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            LaunchConfig config = {st->grid[0], st->grid[1], st->grid[2], st->block[0], st->block[1],
                                   st->block[2], st->shared, stream, &attribute, 1};
            if ((r = cuLaunchKernelEx_(&config, st->function, st->pointers, NULL)))
                return launch_failed("cuLaunchKernelEx", r, i);
        } else if ((r = cuLaunchKernel_(st->function, st->grid[0], st->grid[1], st->grid[2], st->block[0],
                                        st->block[1], st->block[2], st->shared, stream, st->pointers, NULL))) {
            return launch_failed("cuLaunchKernel", r, i);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Call_call(CallObject *self, PyObject *args, PyObject *kwargs) {
    uint64_t arg_ptrs[MAX_ARGS], buffers[MAX_BUFFERS];
    PyObject *allocated[MAX_BUFFERS], *maps[MAX_MAPS], *result = NULL, *launched;
    Py_ssize_t n_allocated = 0, n_maps = 0;
    if (!cuLaunchKernel_ || !self->record) {
        PyErr_SetString(PyExc_RuntimeError, "fastcall: configure() was not called, or the Call has no record");
        return NULL;
    }
    if (kwargs && PyDict_GET_SIZE(kwargs)) Py_RETURN_NONE;
    if (PyTuple_GET_SIZE(args) != self->n_args) Py_RETURN_NONE;
    int held = guards_hold(self);
    if (held < 0) return NULL;
    if (!held) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < self->n_args; i++) {
        const ArgSpec *s = &self->args[i];
        PyObject *x = PyTuple_GET_ITEM(args, i);
        int ok;
        if (s->kind == ARG_TENSOR) {
            ok = tensor_matches(s, x, &arg_ptrs[i]);
        } else {
            ok = Py_TYPE(x) != s->type ? 0 : x == s->value ? 1 : same_value(x, s->value);
        }
        if (ok < 0) return NULL;
        if (!ok) Py_RETURN_NONE;
    }
    for (Py_ssize_t d = 0; d < self->n_disjoint; d++) {   /* a kernel writing memory another argument holds */
        Py_ssize_t o = self->disjoint[d];
        for (Py_ssize_t i = 0; i < self->n_args; i++) {
            if (i == o || self->args[i].kind != ARG_TENSOR) continue;
            if (arg_ptrs[i] < arg_ptrs[o] + (uint64_t)self->args[o].nbytes &&
                arg_ptrs[o] < arg_ptrs[i] + (uint64_t)self->args[i].nbytes)
                Py_RETURN_NONE;
        }
    }
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) buffers[i] = arg_ptrs[self->inputs[i]];
    for (; n_allocated < self->n_allocs; n_allocated++) {
        PyObject *t = allocate(&self->allocs[n_allocated], args, &buffers[self->n_inputs + n_allocated]);
        if (!t) goto done;
        allocated[n_allocated] = t;
    }
    PyObject *raw = PyObject_CallOneArg(self->stream, self->stream_arg);
    if (!raw) goto done;
    void *stream = as_pointer(raw);
    Py_DECREF(raw);
    if (PyErr_Occurred()) goto done;
    for (Py_ssize_t i = 0; i < self->n_steps; i++) {
        for (Py_ssize_t j = 0; j < self->steps[i].n_params; j++) {
            Param *p = &self->steps[i].params[j];
            if (p->kind != PARAM_TENSOR_MAP) continue;
            if (p->last_map && p->last_ptr == buffers[p->buffer]) {
                Py_INCREF(p->last_map);   /* (taken before any Python runs: another thread may replace it) */
                maps[n_maps++] = p->last_map;
                continue;
            }
            PyObject *ptr = PyLong_FromUnsignedLongLong(buffers[p->buffer]);
            PyObject *map = ptr ? PyObject_CallFunctionObjArgs(self->encode, ptr, p->spec, NULL) : NULL;
            Py_XDECREF(ptr);
            if (!map) goto done;
            maps[n_maps++] = map;
            if (!PyBytes_Check(map) || PyBytes_GET_SIZE(map) != SLOT_BYTES) {
                PyErr_SetString(PyExc_ValueError, "fastcall: encode() must return the 128 bytes of a tensor map");
                goto done;
            }
            Py_INCREF(map);
            Py_XSETREF(p->last_map, map);
            p->last_ptr = buffers[p->buffer];
        }
    }
    launched = launch_all(self, buffers, maps, stream);
    if (!launched) goto done;
    Py_DECREF(launched);
    if (self->n_results == 1) {   /* (a kernel's call, writing into its arguments, returns ()) */
        result = allocated[0];
        Py_INCREF(result);
    } else {
        result = PyTuple_New(self->n_results);
        for (Py_ssize_t i = 0; result && i < self->n_results; i++) {
            Py_INCREF(allocated[i]);
            PyTuple_SET_ITEM(result, i, allocated[i]);
        }
    }
done:
    for (Py_ssize_t i = 0; i < n_allocated; i++) Py_DECREF(allocated[i]);
    for (Py_ssize_t i = 0; i < n_maps; i++) Py_DECREF(maps[i]);
    return result;
}

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tessera_fastcall.Call",
    .tp_basicsize = sizeof(CallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A bound call of a compiled function: call it with the arguments; None when they differ.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Call_init,
    .tp_dealloc = (destructor)Call_dealloc,
    .tp_call = (ternaryfunc)Call_call,
};

/* configure(library, on_error): the driver's entry points from `library` (dlopen'ed). */
static PyObject *configure(PyObject *module, PyObject *args) {
    const char *library;
    PyObject *handler;
    if (!PyArg_ParseTuple(args, "sO", &library, &handler)) return NULL;
    void *lib = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return PyErr_Format(PyExc_OSError, "fastcall: cannot load %s: %s", library, dlerror());
    void *launch = dlsym(lib, "cuLaunchKernel"), *launch_ex = dlsym(lib, "cuLaunchKernelEx");
    void *get = dlsym(lib, "cuCtxGetCurrent"), *set = dlsym(lib, "cuCtxSetCurrent");
    if (!launch || !launch_ex || !get || !set)
        return PyErr_Format(PyExc_OSError, "fastcall: %s lacks a driver entry point", library);
    cuLaunchKernel_ = launch;
    cuLaunchKernelEx_ = launch_ex;
    cuCtxGetCurrent_ = get;
    cuCtxSetCurrent_ = set;
    Py_INCREF(handler);
    Py_XSETREF(on_error, handler);
    Py_RETURN_NONE;
}

/* layout(): the launch structs' sizes and field offsets and the attribute id, which a test compares
 * with cuda.h's. */
static PyObject *layout(PyObject *module, PyObject *unused) {
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:i}", "attribute_size", sizeof(LaunchAttribute),
                         "attribute_value", offsetof(LaunchAttribute, value), "config_size", sizeof(LaunchConfig),
                         "config_shared", offsetof(LaunchConfig, sharedMemBytes), "config_stream",
                         offsetof(LaunchConfig, hStream), "config_attrs", offsetof(LaunchConfig, attrs),
                         "config_num_attrs", offsetof(LaunchConfig, numAttrs),
                         "programmatic_id", PROGRAMMATIC_STREAM_SERIALIZATION);
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(library, on_error): the CUDA driver's entry points"},
    {"layout", layout, METH_NOARGS, "the launch structs' field offsets"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tessera_fastcall", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tessera_fastcall(void) {
    if (PyType_Ready(&CallType) < 0) return NULL;
    s_dtype = PyUnicode_InternFromString("dtype");
    s_shape = PyUnicode_InternFromString("shape");
    s_requires_grad = PyUnicode_InternFromString("requires_grad");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_stride = PyUnicode_InternFromString("stride");
    s_get_device = PyUnicode_InternFromString("get_device");
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    Py_INCREF(&CallType);
    if (PyModule_AddObject(m, "Call", (PyObject *)&CallType) < 0) {
        Py_DECREF(&CallType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
