//! Vectorised key hashing for the hash partitioner: one pass per key column over its native
//! values (as DataFusion's repartition hashes), instead of converting rows to the row format
//! and hashing each row's bytes.
//!
//! The hash is a pure function of the key *values*, so it is the same in every process, and
//! values that compare equal across encodings hash equal: Utf8, LargeUtf8, Utf8View and
//! dictionaries of them hash their bytes; every signed integer type hashes its value as i64,
//! every unsigned one as u64 (so two join sides whose key types differ in width still agree).
//! Types without a native path return `None` and the caller falls back to the row format.

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, GenericByteArray, GenericByteViewArray, PrimitiveArray,
};
use arrow::datatypes::ArrowNativeType;
use arrow::datatypes::{
    ArrowDictionaryKeyType, ArrowPrimitiveType, ByteArrayType, ByteViewType, DataType, Date32Type,
    Date64Type, Decimal128Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type,
    Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use xxhash_rust::xxh3::xxh3_64;

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;
const NULL_HASH: u64 = 0x2545_F491_4F6C_DD1D;

/// The murmur3 64-bit finaliser: a full avalanche of one word.
#[inline]
fn fmix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[inline]
fn combine(acc: u64, value: u64) -> u64 {
    fmix(acc.rotate_left(23) ^ value)
}

/// Whether every key type has a native path.
pub fn supported(t: &DataType) -> bool {
    use DataType::*;
    match t {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Date32 | Date64
        | Float32 | Float64 | Decimal128(..) | Boolean | Utf8 | LargeUtf8 | Utf8View | Binary
        | LargeBinary | BinaryView => true,
        Dictionary(k, v) => k.is_integer() && supported(v),
        _ => false,
    }
}

/// The hash of every row of `cols` (all of supported types, equal lengths).
pub fn hash_rows(cols: &[ArrayRef], rows: usize) -> Option<Vec<u64>> {
    let mut hashes = vec![SEED; rows];
    for c in cols {
        let values = value_hashes(c.as_ref())?;
        for (h, v) in hashes.iter_mut().zip(values) {
            *h = combine(*h, v);
        }
    }
    Some(hashes)
}

/// One hash per value of `a` (nulls hash to a constant).
fn value_hashes(a: &dyn Array) -> Option<Vec<u64>> {
    use DataType::*;
    let signed = |v: i64| fmix(v as u64 ^ SEED);
    let unsigned = |v: u64| fmix(v ^ SEED.rotate_left(1));
    Some(match a.data_type() {
        Int8 => primitive::<Int8Type>(a, |v| signed(v as i64)),
        Int16 => primitive::<Int16Type>(a, |v| signed(v as i64)),
        Int32 => primitive::<Int32Type>(a, |v| signed(v as i64)),
        Int64 => primitive::<Int64Type>(a, signed),
        Date32 => primitive::<Date32Type>(a, |v| signed(v as i64)),
        Date64 => primitive::<Date64Type>(a, signed),
        UInt8 => primitive::<UInt8Type>(a, |v| unsigned(v as u64)),
        UInt16 => primitive::<UInt16Type>(a, |v| unsigned(v as u64)),
        UInt32 => primitive::<UInt32Type>(a, |v| unsigned(v as u64)),
        UInt64 => primitive::<UInt64Type>(a, unsigned),
        Decimal128(..) => {
            primitive::<Decimal128Type>(a, |v| combine(fmix(v as u64 ^ SEED), (v >> 64) as u64))
        }
        // -0.0 equals 0.0: hash them alike.
        Float32 => primitive::<Float32Type>(a, |v| {
            let v = if v == 0.0 { 0.0f64 } else { v as f64 };
            fmix(v.to_bits() ^ SEED)
        }),
        Float64 => primitive::<Float64Type>(a, |v| {
            let v = if v == 0.0 { 0.0 } else { v };
            fmix(v.to_bits() ^ SEED)
        }),
        Boolean => {
            let b: &BooleanArray = a.as_boolean();
            (0..b.len())
                .map(|i| {
                    if b.is_null(i) {
                        NULL_HASH
                    } else {
                        unsigned(b.value(i) as u64)
                    }
                })
                .collect()
        }
        Utf8 => bytes(a.as_string::<i32>()),
        LargeUtf8 => bytes(a.as_string::<i64>()),
        Binary => bytes(a.as_binary::<i32>()),
        LargeBinary => bytes(a.as_binary::<i64>()),
        Utf8View => views(a.as_string_view()),
        BinaryView => views(a.as_binary_view()),
        Dictionary(k, _) => match k.as_ref() {
            Int8 => dictionary::<Int8Type>(a)?,
            Int16 => dictionary::<Int16Type>(a)?,
            Int32 => dictionary::<Int32Type>(a)?,
            Int64 => dictionary::<Int64Type>(a)?,
            UInt8 => dictionary::<UInt8Type>(a)?,
            UInt16 => dictionary::<UInt16Type>(a)?,
            UInt32 => dictionary::<UInt32Type>(a)?,
            UInt64 => dictionary::<UInt64Type>(a)?,
            _ => return None,
        },
        _ => return None,
    })
}

fn primitive<T: ArrowPrimitiveType>(a: &dyn Array, f: impl Fn(T::Native) -> u64) -> Vec<u64> {
    let p: &PrimitiveArray<T> = a.as_primitive();
    let mut out: Vec<u64> = p.values().iter().map(|v| f(*v)).collect();
    if p.null_count() > 0 {
        for (i, h) in out.iter_mut().enumerate() {
            if p.is_null(i) {
                *h = NULL_HASH;
            }
        }
    }
    out
}

/// xxh3 of every value's bytes (nulls hash to a constant).
fn hash_bytes<'a>(
    len: usize,
    is_null: impl Fn(usize) -> bool,
    value: impl Fn(usize) -> &'a [u8],
) -> Vec<u64> {
    (0..len)
        .map(|i| {
            if is_null(i) {
                NULL_HASH
            } else {
                xxh3_64(value(i))
            }
        })
        .collect()
}

fn bytes<T: ByteArrayType>(a: &GenericByteArray<T>) -> Vec<u64> {
    hash_bytes(a.len(), |i| a.is_null(i), |i| a.value(i).as_ref())
}

fn views<T: ByteViewType + ?Sized>(a: &GenericByteViewArray<T>) -> Vec<u64> {
    hash_bytes(a.len(), |i| a.is_null(i), |i| a.value(i).as_ref())
}

fn dictionary<K: ArrowDictionaryKeyType>(a: &dyn Array) -> Option<Vec<u64>> {
    let d = a.as_dictionary::<K>();
    let values = value_hashes(d.values().as_ref())?;
    Some(
        (0..d.len())
            .map(|i| {
                if d.is_null(i) {
                    return NULL_HASH;
                }
                let k = d.keys().value(i).as_usize();
                // A null value behind a valid key is a null too.
                if d.values().is_null(k) {
                    NULL_HASH
                } else {
                    values.get(k).copied().unwrap_or(NULL_HASH)
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        DictionaryArray, Int32Array, Int64Array, LargeStringArray, StringArray, StringViewArray,
    };
    use proptest::prelude::*;
    use std::sync::Arc;

    proptest! {
        /// Equal values hash equal whatever their encoding, with or without nulls.
        #[test]
        fn encodings_of_equal_values_hash_alike(vals in prop::collection::vec(prop::option::of("[a-c]{0,3}"), 1..100),
                                               ints in prop::collection::vec(prop::option::of(-5i32..5), 1..100)) {
            let utf8: StringArray = vals.iter().map(|v| v.as_deref()).collect();
            let large: LargeStringArray = vals.iter().map(|v| v.as_deref()).collect();
            let view: StringViewArray = vals.iter().map(|v| v.as_deref()).collect();
            let dict: DictionaryArray<Int32Type> = vals.iter().map(|v| v.as_deref()).collect();
            let h = |a: ArrayRef| hash_rows(&[a], vals.len()).unwrap();
            let base = h(Arc::new(utf8));
            prop_assert_eq!(&base, &h(Arc::new(large)));
            prop_assert_eq!(&base, &h(Arc::new(view)));
            prop_assert_eq!(&base, &h(Arc::new(dict)));
            let i32s: Int32Array = ints.iter().copied().collect();
            let i64s: Int64Array = ints.iter().map(|v| v.map(|x| x as i64)).collect();
            prop_assert_eq!(hash_rows(&[Arc::new(i32s)], ints.len()), hash_rows(&[Arc::new(i64s)], ints.len()));
        }
    }

    #[test]
    fn spreads_sequential_keys_evenly() {
        let keys: Int64Array = (0..100_000i64).collect();
        let h = hash_rows(&[Arc::new(keys)], 100_000).unwrap();
        let mut counts = [0usize; 16];
        for x in h {
            counts[(x % 16) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*max - *min < 1_000, "{counts:?}");
    }
}
