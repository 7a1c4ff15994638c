"""Element types: names as NumPy spells them, mapped to DLPack (code, bits, lanes).

A dtype may be given as a string ('float32', 'bfloat16', 'bool', 'complex64'), a NumPy
dtype or scalar type, a torch dtype (torch.float32) or anything whose str() ends in one of
the names. bfloat16 has no NumPy equivalent; it is carried by its DLPack code (4, 16 bits).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

__all__ = ["DType", "DTypeLike", "dtype", "from_dlpack_code"]

# DLPack DLDataTypeCode values.
INT, UINT, FLOAT, OPAQUE, BFLOAT, COMPLEX, BOOL = 0, 1, 2, 3, 4, 5, 6


class DType(NamedTuple):
    """(name, code, bits, lanes) with the NumPy array-interface type string, if any."""

    name: str
    code: int
    bits: int
    lanes: int = 1
    # NumPy __array_interface__ typestr; None when NumPy has no such type (bfloat16).
    typestr: Optional[str] = None

    @property
    def itemsize(self) -> int:
        return (self.bits * self.lanes + 7) // 8

    @property
    def raw_typestr(self) -> str:
        """A NumPy type of the same size, for copying the bits of any element type."""
        n = self.itemsize
        return {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(n, "|V%d" % n)

    def __repr__(self) -> str:
        return "gpupool.dtype(%r)" % self.name

    def __str__(self) -> str:
        return self.name


_TABLE = [
    DType("int8", INT, 8, 1, "|i1"),
    DType("int16", INT, 16, 1, "<i2"),
    DType("int32", INT, 32, 1, "<i4"),
    DType("int64", INT, 64, 1, "<i8"),
    DType("uint8", UINT, 8, 1, "|u1"),
    DType("uint16", UINT, 16, 1, "<u2"),
    DType("uint32", UINT, 32, 1, "<u4"),
    DType("uint64", UINT, 64, 1, "<u8"),
    DType("float16", FLOAT, 16, 1, "<f2"),
    DType("float32", FLOAT, 32, 1, "<f4"),
    DType("float64", FLOAT, 64, 1, "<f8"),
    DType("bfloat16", BFLOAT, 16, 1, None),
    DType("complex64", COMPLEX, 64, 1, "<c8"),
    DType("complex128", COMPLEX, 128, 1, "<c16"),
    DType("bool", BOOL, 8, 1, "|b1"),
]
_BY_NAME = {d.name: d for d in _TABLE}
_BY_CODE = {(d.code, d.bits, d.lanes): d for d in _TABLE}
_ALIASES = {
    "bool_": "bool", "b1": "bool", "half": "float16", "double": "float64",
    "f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16",
    "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32",
    "u8": "uint64", "c8": "complex64", "c16": "complex128", "cfloat": "complex64",
    "cdouble": "complex128", "bf16": "bfloat16",
}


# What the API takes as an element type: a name, a NumPy or torch dtype, or a DType.
DTypeLike = Union[str, DType, Any]


def dtype(d: DTypeLike) -> DType:
    """The DType for d (a name, a NumPy/torch dtype, or a DType); ValueError if unknown."""
    if isinstance(d, DType):
        return d
    name = d if isinstance(d, str) else getattr(d, "name", None)
    if not isinstance(name, str):
        # torch dtypes print as 'torch.float32'; NumPy scalar types (np.float32) have no
        # .name of their own but numpy.dtype() knows them.
        name = str(d)
        if not name.startswith("torch."):
            try:
                import numpy

                name = numpy.dtype(d).name
            except Exception:
                pass
    key = name.strip().lower()
    if key.startswith("torch.") or key.startswith("jnp."):
        key = key.split(".", 1)[1]
    key = key.lstrip("<>|=")
    key = _ALIASES.get(key, key)
    if key not in _BY_NAME and isinstance(d, str):
        try:
            import numpy

            key = numpy.dtype(d).name
        except Exception:
            pass
    try:
        return _BY_NAME[key]
    except KeyError:
        raise ValueError(
            "unsupported dtype %r: gpupool tensors take one of %s"
            % (d, ", ".join(x.name for x in _TABLE))) from None


def from_dlpack_code(code: int, bits: int, lanes: int) -> DType:
    """The DType for a DLPack data type, or a DType named after the raw code."""
    d = _BY_CODE.get((code, bits, lanes))
    if d is None:
        d = DType("dlpack(%d,%d,%d)" % (code, bits, lanes), code, bits, lanes, None)
    return d


def from_typestr(typestr: str, descr_name: Optional[str] = None) -> DType:
    """The DType for a NumPy array-interface typestr ('<f4', '|b1'); ValueError if none."""
    if descr_name:
        try:
            return dtype(descr_name)
        except ValueError:
            pass
    t = typestr.lstrip("<>|=")
    if typestr[:1] == ">":
        raise ValueError("big-endian data (%s) cannot be published: convert it to "
                         "little-endian first (array.astype(array.dtype.newbyteorder('<')))"
                         % typestr)
    kind, size = t[:1], t[1:]
    names = {"i": "int", "u": "uint", "f": "float", "c": "complex"}
    if kind == "b" and size == "1":
        return _BY_NAME["bool"]
    if kind in names and size.isdigit():
        name = "%s%d" % (names[kind], int(size) * 8)
        if name in _BY_NAME:
            return _BY_NAME[name]
    raise ValueError("unsupported element type %r: gpupool tensors take one of %s"
                     % (typestr, ", ".join(x.name for x in _TABLE)))


ALL = tuple(_TABLE)
