/* The launch path in C: a kernel's arguments bound by name, packed into its parameter
 * buffer and launched with cuLaunchKernelEx, in one call from Python; and
 * cuTensorMapEncodeTiled into a 128-byte descriptor.
 *
 * native.py compiles this file at first use and loads it; launch.py and tensormap.py call
 * it, and go through ctypes and cuda.bindings where it cannot be built. libcuda is opened
 * with dlopen at first use, never linked, so the module builds and loads on a machine
 * without the driver. cuda.h need not be installed: the few driver types used are declared
 * here as cuda.h declares them (with PTXFORGE_CHECK_ABI, the tests compile this file against
 * cuda.h where it is present and hold the two equal).
 *
 * Packing follows Python's struct module with a little-endian format (launch.py's
 * argument_layout), codes I i Q q f d s: the same bytes, and the same message for a value
 * struct refuses. A tensor-map parameter also takes a view, (address, shape, strides),
 * encoded here with what the kernel's TensorMap fixes. Nothing a launch writes outlives the
 * call (the buffer is on the C stack), so threads may launch at once; the GIL is released
 * while the driver runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int DriverResult; /* CUresult: 0 is success */

typedef struct { /* CUlaunchAttribute */
    int id;      /* CUlaunchAttributeID */
    char pad[4];
    uint64_t value[8]; /* CUlaunchAttributeValue: a 64-byte union, 8-aligned */
} LaunchAttribute;

typedef struct { /* CUlaunchConfig */
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void *hStream;
    LaunchAttribute *attrs;
    unsigned int numAttrs;
} LaunchConfig;

typedef struct { /* CUtensorMap */
    _Alignas(128) uint64_t opaque[16];
} TensorMap;

typedef DriverResult (*InitFn)(unsigned int flags);
typedef DriverResult (*LaunchKernelExFn)(const LaunchConfig *config, void *function,
                                         void **kernelParams, void **extra);
typedef DriverResult (*TensorMapEncodeTiledFn)(
    TensorMap *tensorMap, int dataType, uint32_t rank, void *globalAddress,
    const uint64_t *globalDim, const uint64_t *globalStrides, const uint32_t *boxDim,
    const uint32_t *elementStrides, int interleave, int swizzle, int l2Promotion, int oobFill);

#ifdef PTXFORGE_CHECK_ABI
#include <cuda.h>
#define SAME_FIELD(ours, theirs, field) \
    _Static_assert(offsetof(ours, field) == offsetof(theirs, field), #theirs "." #field)
_Static_assert(sizeof(LaunchAttribute) == sizeof(CUlaunchAttribute), "CUlaunchAttribute");
_Static_assert(_Alignof(LaunchAttribute) == _Alignof(CUlaunchAttribute), "CUlaunchAttribute");
SAME_FIELD(LaunchAttribute, CUlaunchAttribute, value);
_Static_assert(sizeof(((LaunchAttribute *)0)->id) == sizeof(CUlaunchAttributeID), "id");
_Static_assert(sizeof(LaunchConfig) == sizeof(CUlaunchConfig), "CUlaunchConfig");
SAME_FIELD(LaunchConfig, CUlaunchConfig, gridDimX);
SAME_FIELD(LaunchConfig, CUlaunchConfig, blockDimX);
SAME_FIELD(LaunchConfig, CUlaunchConfig, sharedMemBytes);
SAME_FIELD(LaunchConfig, CUlaunchConfig, hStream);
SAME_FIELD(LaunchConfig, CUlaunchConfig, attrs);
SAME_FIELD(LaunchConfig, CUlaunchConfig, numAttrs);
_Static_assert(sizeof(TensorMap) == sizeof(CUtensorMap), "CUtensorMap");
_Static_assert(sizeof(CUtensorMapDataType) == sizeof(int), "enums are passed as int");
_Static_assert(sizeof(CUresult) == sizeof(DriverResult), "CUresult");
#endif

static LaunchKernelExFn launch_kernel_ex;
static TensorMapEncodeTiledFn tensor_map_encode_tiled;

/* Open libcuda and find its functions, once (callers hold the GIL). 0, with OSError set,
 * where it cannot be opened. A failed cuInit is not reported here: the calls after it
 * return their own error. */
static int driver_ready(void)
{
    if (launch_kernel_ex)
        return 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        PyErr_SetString(PyExc_OSError, dlerror());
        return 0;
    }
    InitFn init = (InitFn)dlsym(lib, "cuInit");
    LaunchKernelExFn launch = (LaunchKernelExFn)dlsym(lib, "cuLaunchKernelEx");
    TensorMapEncodeTiledFn encode = (TensorMapEncodeTiledFn)dlsym(lib, "cuTensorMapEncodeTiled");
    if (!init || !launch || !encode) {
        PyErr_SetString(PyExc_OSError, "libcuda.so.1 has no cuLaunchKernelEx or "
                                       "cuTensorMapEncodeTiled (a driver older than CUDA 12)");
        return 0;
    }
    init(0);
    tensor_map_encode_tiled = encode;
    launch_kernel_ex = launch;
    return 1;
}

/* A kernel's parameters take at most this many bytes (the CUDA limit on sm_70 and later):
 * the buffer packed on the C stack is never larger. */
#define MAX_PARAMETER_BYTES 32764

/* What a descriptor takes besides its tensor's address, shape and strides: as tensormap.py's
 * driver_encoding gives it, (data type, box, swizzle, L2 promotion, OOB fill, alignment),
 * the enums as the driver numbers them, the box innermost first. rank 0: none. */
typedef struct {
    int data_type, swizzle, l2_promotion, oob_fill;
    Py_ssize_t rank;
    uint32_t box[5];
    uint64_t alignment; /* of the address and the strides, in bytes */
} Encoding;

/* An int, or anything with __index__ (numpy and torch integers), as an unsigned 64-bit
 * value: 0 with an exception set when it is not one. */
static int read_u64(PyObject *value, unsigned long long *out)
{
    PyObject *n = PyNumber_Index(value);
    if (!n)
        return 0;
    *out = PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    return !(*out == (unsigned long long)-1 && PyErr_Occurred());
}

/* Read a sequence of count ints into out, each at most limit. 0 with ValueError set when
 * it is not that. */
static int read_dims(PyObject *sequence, const char *name, Py_ssize_t count, uint64_t limit,
                     uint64_t *out)
{
    PyObject *items = PySequence_Fast(sequence, "");
    int ok = items && PySequence_Fast_GET_SIZE(items) == count;
    for (Py_ssize_t i = 0; ok && i < count; i++) {
        unsigned long long x;
        ok = read_u64(PySequence_Fast_GET_ITEM(items, i), &x) && x <= limit;
        out[i] = x;
    }
    Py_XDECREF(items);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be %zd ints in [0, %llu], got %R", name, count,
                     (unsigned long long)limit, sequence);
    }
    return ok;
}

static int read_encoding(PyObject *spec, Encoding *out)
{
    PyObject *box;
    unsigned long long alignment;
    if (!PyArg_ParseTuple(spec, "iOiiiK", &out->data_type, &box, &out->swizzle,
                          &out->l2_promotion, &out->oob_fill, &alignment))
        return 0;
    uint64_t dims[5];
    out->rank = PyObject_Length(box);
    if (out->rank < 1 || out->rank > 5 || !alignment) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "a tensor map has 1 to 5 dimensions and an alignment, "
                     "got %R", spec);
        return 0;
    }
    if (!read_dims(box, "box", out->rank, UINT32_MAX, dims))
        return 0;
    for (Py_ssize_t i = 0; i < out->rank; i++)
        out->box[i] = (uint32_t)dims[i];
    out->alignment = alignment;
    return 1;
}

/* cuTensorMapEncodeTiled of the tensor at address with shape and strides (byte strides of
 * dimensions 1..) into map: 1 with *result the driver's CUresult; 0 with an exception set
 * when the view does not fit the encoding (rank, alignment) or libcuda is missing. */
static int encode(const Encoding *e, PyObject *address, PyObject *shape, PyObject *strides,
                  TensorMap *map, DriverResult *result)
{
    static const uint32_t element_strides[5] = {1, 1, 1, 1, 1};
    uint64_t dims[5], steps[5];
    unsigned long long start;
    if (!read_u64(address, &start)
        || !read_dims(shape, "shape", e->rank, UINT64_MAX, dims)
        || !read_dims(strides, "strides", e->rank - 1, UINT64_MAX, steps))
        return 0;
    uint64_t misaligned = start % e->alignment;
    for (Py_ssize_t i = 0; i < e->rank - 1; i++)
        misaligned |= steps[i] % e->alignment;
    if (misaligned) {
        PyErr_Format(PyExc_ValueError, "TMA needs %llu-byte aligned addresses and strides",
                     (unsigned long long)e->alignment);
        return 0;
    }
    if (!driver_ready())
        return 0;
    *result = tensor_map_encode_tiled(map, e->data_type, (uint32_t)e->rank,
                                      (void *)(uintptr_t)start, dims, steps, e->box,
                                      element_strides, 0, e->swizzle, e->l2_promotion,
                                      e->oob_fill);
    return 1;
}

static PyObject *PackingError;

/* The bytes each struct code takes. */
static Py_ssize_t code_size(char code)
{
    switch (code) {
    case 'I': case 'i': case 'f': return 4;
    case 'Q': case 'q': case 'd': return 8;
    case 's': return 128;
    default: return 0;
    }
}

/* An int for struct's integer codes: the value itself or its __index__ (whose own error
 * propagates, as struct lets it). NULL with *detail set when the value has neither. */
static PyObject *as_integer(PyObject *value, const char **detail)
{
    if (PyLong_Check(value))
        return Py_NewRef(value);
    if (PyIndex_Check(value))
        return PyNumber_Index(value);
    *detail = "needs an integer";
    return NULL;
}

/* The refusal of an integer outside struct code's range (launch.py's _why words it alike). */
static const char *range_of(char code)
{
    switch (code) {
    case 'I': return "outside [0, 4294967295]";
    case 'i': return "outside [-2147483648, 2147483647]";
    case 'Q': return "outside [0, 18446744073709551615]";
    default: return "outside [-9223372036854775808, 9223372036854775807]";
    }
}

/* An OverflowError is a refusal (*detail: the code's range); another error propagates. */
static int out_of_range(char code, const char **detail)
{
    if (!PyErr_ExceptionMatches(PyExc_OverflowError))
        return -1;
    PyErr_Clear();
    *detail = range_of(code);
    return 1;
}

/* Write ``value`` as struct ``code`` at ``slot``: 0 when written, 1 with *detail set when
 * struct would refuse the value, -1 with a Python exception set otherwise. */
static int pack_value(char code, PyObject *value, unsigned char *slot, const char **detail)
{
    if (code == 's') {
        const char *data;
        Py_ssize_t n;
        if (PyBytes_Check(value)) {
            data = PyBytes_AS_STRING(value);
            n = PyBytes_GET_SIZE(value);
        } else if (PyByteArray_Check(value)) {
            data = PyByteArray_AS_STRING(value);
            n = PyByteArray_GET_SIZE(value);
        } else {
            *detail = "needs 128 bytes (an encoded tensor map) or a view (address, shape, byte strides)";
            return 1;
        }
        memcpy(slot, data, n < 128 ? n : 128); /* struct pads a short one with zeros */
        return 0;
    }
    if (code == 'f' || code == 'd') {
        double x = PyFloat_AsDouble(value);
        if (x == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError))
                *detail = code == 'd' ? "too large for f64" : "too large for f32";
            else if (PyErr_ExceptionMatches(PyExc_TypeError))
                *detail = "needs a float";
            else
                return -1; /* the value's own __float__ failed: as struct, let it through */
            PyErr_Clear();
            return 1;
        }
        if (code == 'd') {
            memcpy(slot, &x, 8);
            return 0;
        }
        float y = (float)x;
        if (isinf(y) && !isinf(x)) {
            *detail = "too large for f32";
            return 1;
        }
        memcpy(slot, &y, 4);
        return 0;
    }
    PyObject *n = as_integer(value, detail);
    if (!n)
        return *detail ? 1 : -1;
    switch (code) {
    case 'I': {
        unsigned long x = PyLong_AsUnsignedLong(n);
        Py_DECREF(n);
        if (x == (unsigned long)-1 && PyErr_Occurred())
            return out_of_range(code, detail);
        if (x > UINT32_MAX) {
            *detail = range_of(code);
            return 1;
        }
        uint32_t v = (uint32_t)x;
        memcpy(slot, &v, 4);
        return 0;
    }
    case 'i': {
        long x = PyLong_AsLong(n);
        Py_DECREF(n);
        if (x == -1 && PyErr_Occurred())
            return out_of_range(code, detail);
        if (x < INT32_MIN || x > INT32_MAX) {
            *detail = range_of(code);
            return 1;
        }
        int32_t v = (int32_t)x;
        memcpy(slot, &v, 4);
        return 0;
    }
    case 'Q': {
        unsigned long long x = PyLong_AsUnsignedLongLong(n);
        Py_DECREF(n);
        if (x == (unsigned long long)-1 && PyErr_Occurred())
            return out_of_range(code, detail);
        uint64_t v = x;
        memcpy(slot, &v, 8);
        return 0;
    }
    default: { /* 'q' */
        long long x = PyLong_AsLongLong(n);
        Py_DECREF(n);
        if (x == -1 && PyErr_Occurred())
            return out_of_range(code, detail);
        int64_t v = x;
        memcpy(slot, &v, 8);
        return 0;
    }
    }
}

/* One kernel's launcher: the parameter layout, block, dynamic shared memory and launch
 * attributes fixed at creation, and the Python launcher it stands for (its owner). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *owner; /* launch.Launcher: its attributes, and the call that reports errors */
    PyObject *names; /* the parameters' names, interned, in order */
    void *function;
    Py_ssize_t count; /* parameters */
    Py_ssize_t size;  /* bytes of the parameter buffer */
    char *codes;      /* a struct code per parameter */
    Py_ssize_t *offsets;
    Encoding *encodings; /* per parameter: how a view given for it is encoded (rank 0: none) */
    unsigned int block, shared_bytes, num_attrs;
    LaunchAttribute *attrs;
} Launch;

/* Encode a view, (address, shape, strides), into the 128 bytes at slot: as pack_value. */
static int pack_view(const Encoding *e, PyObject *view, unsigned char *slot, const char **detail)
{
    TensorMap map;
    DriverResult result = 0;
    if (PyTuple_GET_SIZE(view) != 3
        || !encode(e, PyTuple_GET_ITEM(view, 0), PyTuple_GET_ITEM(view, 1),
                   PyTuple_GET_ITEM(view, 2), &map, &result)
        || result) {
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_OSError))
            return -1; /* no libcuda */
        PyErr_Clear();
        *detail = "a view (address, shape, strides) the kernel's TensorMap cannot describe";
        return 1;
    }
    memcpy(slot, map.opaque, sizeof map.opaque);
    return 0;
}

/* Pack the count values into buffer (size bytes, zeroed first like struct's padding).
 * 0 with PackingError(index, detail, value) or another exception set on failure. */
static int pack(Launch *self, PyObject *const *values, unsigned char *buffer)
{
    memset(buffer, 0, self->size);
    for (Py_ssize_t i = 0; i < self->count; i++) {
        const char *detail = NULL;
        unsigned char *slot = buffer + self->offsets[i];
        int status = self->encodings[i].rank && PyTuple_CheckExact(values[i])
                         ? pack_view(&self->encodings[i], values[i], slot, &detail)
                         : pack_value(self->codes[i], values[i], slot, &detail);
        if (status == 1) {
            PyObject *args = Py_BuildValue("(nsO)", i, detail, values[i]);
            if (args) {
                PyErr_SetObject(PackingError, args);
                Py_DECREF(args);
            }
        }
        if (status)
            return 0;
    }
    return 1;
}

static int read_uint32(PyObject *value, unsigned int *out)
{
    unsigned long long x;
    if (!read_u64(value, &x) || x > UINT32_MAX)
        return 0;
    *out = (unsigned int)x;
    return 1;
}

static int read_grid(PyObject *grid, LaunchConfig *config)
{
    PyObject *items = PySequence_Fast(grid, "grid must be a sequence of 3 ints");
    if (!items)
        return 0;
    int ok = PySequence_Fast_GET_SIZE(items) == 3;
    PyObject **dims = PySequence_Fast_ITEMS(items);
    ok = ok && read_uint32(dims[0], &config->gridDimX) && read_uint32(dims[1], &config->gridDimY)
         && read_uint32(dims[2], &config->gridDimZ);
    Py_DECREF(items);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "grid must be 3 ints in [0, 2**32), got %R", grid);
    }
    return ok;
}

/* Pack values and launch on grid and stream: 1 with *result the driver's CUresult, 0 with
 * an exception set when the values, grid or stream do not pack or libcuda is missing. */
static int launch_values(Launch *self, PyObject *grid, PyObject *stream, PyObject *const *values,
                         DriverResult *result)
{
    LaunchConfig config = {0};
    if (!read_grid(grid, &config))
        return 0;
    config.hStream = stream == Py_None ? NULL : PyLong_AsVoidPtr(stream);
    if (PyErr_Occurred())
        return 0;
    config.blockDimX = self->block;
    config.blockDimY = config.blockDimZ = 1;
    config.sharedMemBytes = self->shared_bytes;
    config.attrs = self->num_attrs ? self->attrs : NULL;
    config.numAttrs = self->num_attrs;
    unsigned char storage[self->size + 64]; /* tensor maps want 64-byte alignment */
    unsigned char *buffer = (unsigned char *)(((uintptr_t)storage + 63) & ~(uintptr_t)63);
    void *pointers[self->count + 1];
    if (!pack(self, values, buffer) || !driver_ready())
        return 0;
    for (Py_ssize_t i = 0; i < self->count; i++)
        pointers[i] = buffer + self->offsets[i];
    Py_BEGIN_ALLOW_THREADS
    *result = launch_kernel_ex(&config, self->function, pointers, NULL);
    Py_END_ALLOW_THREADS
    return 1;
}

/* The parameter named key: its index, or -1. Call sites name the parameters with
 * interned strings, mostly in order, so the pointer test from ``guess`` on finds them. */
static Py_ssize_t parameter_index(Launch *self, PyObject *key, Py_ssize_t guess)
{
    PyObject **names = &PyTuple_GET_ITEM(self->names, 0);
    for (Py_ssize_t i = 0; i < self->count; i++) {
        Py_ssize_t j = (guess + i) % self->count;
        if (names[j] == key)
            return j;
    }
    for (Py_ssize_t j = 0; j < self->count; j++)
        if (PyUnicode_Check(key) && PyUnicode_Compare(names[j], key) == 0)
            return j;
    return -1;
}

/* launcher(grid, stream, **values): bind the values by name, pack, launch. Anything amiss
 * (a name, a value, the driver's answer) hands the whole call to the owner, the Python
 * launcher, which binds, packs and launches again and reports what went wrong. */
static PyObject *Launch_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames)
{
    Launch *self = (Launch *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 2 && (kwnames ? PyTuple_GET_SIZE(kwnames) : 0) == self->count) {
        PyObject *values[self->count + 1];
        memset(values, 0, sizeof values);
        int bound = 1;
        for (Py_ssize_t k = 0; bound && k < self->count; k++) {
            Py_ssize_t j = parameter_index(self, PyTuple_GET_ITEM(kwnames, k), k);
            bound = j >= 0 && !values[j];
            if (bound)
                values[j] = args[nargs + k];
        }
        DriverResult result;
        if (bound && launch_values(self, args[0], args[1], values, &result) && !result)
            Py_RETURN_NONE;
        PyErr_Clear();
    }
    return PyObject_Vectorcall(self->owner, args, nargsf, kwnames);
}

static int Launch_traverse(Launch *self, visitproc visit, void *arg)
{
    Py_VISIT(self->owner);
    Py_VISIT(self->names);
    return 0;
}

static int Launch_clear(Launch *self)
{
    Py_CLEAR(self->owner);
    Py_CLEAR(self->names);
    return 0;
}

static void Launch_dealloc(Launch *self)
{
    PyObject_GC_UnTrack(self);
    Launch_clear(self);
    PyMem_Free(self->codes);
    PyMem_Free(self->offsets);
    PyMem_Free(self->encodings);
    PyMem_Free(self->attrs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Attributes the launcher lacks are its owner's (name, params, tensor_maps, ...). */
static PyObject *Launch_getattro(PyObject *self, PyObject *name)
{
    PyObject *found = PyObject_GenericGetAttr(self, name);
    if (found || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return found;
    PyErr_Clear();
    return PyObject_GetAttr(((Launch *)self)->owner, name);
}

/* Launch(owner, function, names, codes, offsets, encodings, size, block, shared_bytes,
 * attributes): names a tuple of str, codes a str of struct codes, one per parameter,
 * offsets their byte offsets in a buffer of size bytes, encodings None or, for a
 * tensor-map parameter, what encodes a view given for it; attributes (id, first 64-bit
 * word of the value, second word) triples. */
static PyObject *Launch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *owner, *function, *names, *offsets, *encodings, *attributes;
    const char *codes;
    Py_ssize_t count, size;
    unsigned int block, shared_bytes;
    static char *keywords[] = {"owner", "function", "names", "codes", "offsets", "encodings",
                               "size", "block", "shared_bytes", "attributes", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!s#O!O!nIIO:Launch", keywords, &owner,
                                     &function, &PyTuple_Type, &names, &codes, &count,
                                     &PyTuple_Type, &offsets, &PyTuple_Type, &encodings, &size,
                                     &block, &shared_bytes, &attributes))
        return NULL;
    void *handle = PyLong_AsVoidPtr(function);
    if (PyErr_Occurred())
        return NULL;
    PyObject *attribute_items = PySequence_Fast(attributes, "attributes must be a sequence");
    if (!attribute_items)
        return NULL;
    Launch *self = (Launch *)type->tp_alloc(type, 0);
    Py_ssize_t num_attrs = PySequence_Fast_GET_SIZE(attribute_items);
    if (!self)
        goto fail;
    self->vectorcall = Launch_vectorcall;
    self->owner = Py_NewRef(owner);
    self->function = handle;
    self->count = count;
    self->size = size;
    self->block = block;
    self->shared_bytes = shared_bytes;
    self->codes = PyMem_Malloc(count + 1);
    self->offsets = PyMem_Calloc(count + 1, sizeof(Py_ssize_t));
    self->encodings = PyMem_Calloc(count + 1, sizeof(Encoding));
    self->attrs = PyMem_Calloc(num_attrs + 1, sizeof(LaunchAttribute));
    if (!self->codes || !self->offsets || !self->encodings || !self->attrs) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(self->codes, codes, count);
    if (PyTuple_GET_SIZE(names) != count || PyTuple_GET_SIZE(offsets) != count
        || PyTuple_GET_SIZE(encodings) != count || size < 0 || size > MAX_PARAMETER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "Launch needs a name, an offset and an encoding per "
                                          "code, and a size in [0, 32764]");
        goto fail;
    }
    self->names = PyTuple_New(count);
    if (!self->names)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_SetString(PyExc_TypeError, "parameter names must be str");
            goto fail;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        PyTuple_SET_ITEM(self->names, i, name);
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, i));
        if (offset == -1 && PyErr_Occurred())
            goto fail;
        PyObject *encoding = PyTuple_GET_ITEM(encodings, i);
        if (encoding != Py_None
            && (codes[i] != 's' || !read_encoding(encoding, &self->encodings[i]))) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "parameter %zd: only a tensor map has an "
                             "encoding", i);
            goto fail;
        }
        Py_ssize_t width = code_size(codes[i]);
        if (!width || offset < 0 || offset > size - width) {
            PyErr_Format(PyExc_ValueError, "parameter %zd: code %c at offset %zd does not fit "
                         "a %zd-byte buffer", i, codes[i], offset, size);
            goto fail;
        }
        self->offsets[i] = offset;
    }
    for (Py_ssize_t i = 0; i < num_attrs; i++) {
        LaunchAttribute *attr = &self->attrs[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(attribute_items, i), "iKK", &attr->id,
                              &attr->value[0], &attr->value[1]))
            goto fail;
    }
    self->num_attrs = (unsigned int)num_attrs;
    Py_DECREF(attribute_items);
    return (PyObject *)self;
fail:
    Py_XDECREF(self);
    Py_DECREF(attribute_items);
    return NULL;
}

static int check_count(Launch *self, Py_ssize_t given, Py_ssize_t before, const char *what)
{
    if (given == self->count + before)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", what, self->count + before,
                 given);
    return 0;
}

/* launch(grid, stream, *values) -> the CUresult of cuLaunchKernelEx (0: launched);
 * PackingError(index, detail, value) for a value struct would refuse. */
static PyObject *Launch_launch(Launch *self, PyObject *const *args, Py_ssize_t nargs)
{
    DriverResult result;
    if (!check_count(self, nargs, 2, "launch") || !launch_values(self, args[0], args[1],
                                                                 args + 2, &result))
        return NULL;
    return PyLong_FromLong(result);
}

/* pack(*values) -> the parameter buffer launch would pass, as bytes. */
static PyObject *Launch_pack(Launch *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!check_count(self, nargs, 0, "pack"))
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, self->size);
    if (out && !pack(self, args, (unsigned char *)PyBytes_AS_STRING(out)))
        Py_CLEAR(out);
    return out;
}

static PyMethodDef Launch_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))Launch_launch, METH_FASTCALL,
     "launch(grid, stream, *values) -> CUresult: pack the values in order, then "
     "cuLaunchKernelEx."},
    {"pack", (PyCFunction)(void (*)(void))Launch_pack, METH_FASTCALL,
     "pack(*values) -> bytes: the parameter buffer launch would pass."},
    {NULL},
};

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ptxforge_native.Launch",
    .tp_basicsize = sizeof(Launch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A kernel's launcher: launcher(grid, stream, **values) binds, packs, launches.",
    .tp_new = Launch_new,
    .tp_dealloc = (destructor)Launch_dealloc,
    .tp_traverse = (traverseproc)Launch_traverse,
    .tp_clear = (inquiry)Launch_clear,
    .tp_free = PyObject_GC_Del,
    .tp_getattro = Launch_getattro,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Launch, vectorcall),
    .tp_methods = Launch_methods,
};

/* encode_tiled(address, shape, strides, encoding) -> 128 bytes, or the CUresult of a failed
 * cuTensorMapEncodeTiled; encoding as tensormap.py's driver_encoding gives it. */
static PyObject *encode_tiled(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Encoding e;
    TensorMap map;
    DriverResult result;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "encode_tiled takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    if (!read_encoding(args[3], &e) || !encode(&e, args[0], args[1], args[2], &map, &result))
        return NULL;
    if (result)
        return PyLong_FromLong(result);
    return PyBytes_FromStringAndSize((const char *)map.opaque, sizeof map.opaque);
}

static PyMethodDef module_methods[] = {
    {"encode_tiled", (PyCFunction)(void (*)(void))encode_tiled, METH_FASTCALL,
     "encode_tiled(address, shape, strides, encoding) -> 128 bytes, or the CUresult of a "
     "failed cuTensorMapEncodeTiled."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ptxforge_native",
    "ptxforge's launch path in C (see native.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit_ptxforge_native(void)
{
    if (PyType_Ready(&LaunchType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    PackingError = PyErr_NewException("ptxforge_native.PackingError", NULL, NULL);
    if (!PackingError || PyModule_AddObjectRef(module, "PackingError", PackingError) < 0
        || PyModule_AddObjectRef(module, "Launch", (PyObject *)&LaunchType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
