//! `fs_to_double(x)`: `CAST(x AS DOUBLE)`, with the same result, faster for decimals.
//!
//! Online aggregation's statistics query evaluates its sums in DOUBLE from decimal columns
//! (TPC-H's prices, discounts, taxes). Arrow casts a `Decimal128` to `Float64` one value at a
//! time as `x as f64 / 10f64.powi(scale)`: a software 128-bit-to-float conversion and a power
//! per value, 11% of the workers' time in online TPC-H Q1. A decimal of at most 18 digits
//! fits an `i64`, whose conversion is one instruction, and the power is the same for every
//! value: this function computes exactly the same `f64` that way. Other types are cast as
//! `CAST` casts them.
//!
//! Registered in the driver's and the workers' sessions ([`udf`]), so plans using it travel
//! as any built-in function.

use arrow::array::{Array, ArrayRef, AsArray, Float64Array};
use arrow::compute::{cast_with_options, CastOptions};
use arrow::datatypes::{DataType, Decimal128Type, Field, FieldRef};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
    Volatility,
};
use std::sync::Arc;

/// The function's SQL name.
pub const TO_DOUBLE: &str = "fs_to_double";

#[derive(Debug, PartialEq, Eq, Hash)]
struct ToDouble {
    signature: Signature,
}

/// The function, to register with a session.
pub fn udf() -> ScalarUDF {
    ScalarUDF::new_from_impl(ToDouble {
        signature: Signature::any(1, Volatility::Immutable),
    })
}

impl ScalarUDFImpl for ToDouble {
    fn name(&self) -> &str {
        TO_DOUBLE
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _args: &[DataType]) -> Result<DataType> {
        Ok(DataType::Float64)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let nullable = args.arg_fields.iter().any(|f| f.is_nullable());
        Ok(Arc::new(Field::new(TO_DOUBLE, DataType::Float64, nullable)))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let [arg] = args.args.as_slice() else {
            return Err(datafusion::error::DataFusionError::Plan(format!(
                "{TO_DOUBLE} takes one argument, not {}",
                args.args.len()
            )));
        };
        Ok(match arg {
            ColumnarValue::Array(a) => ColumnarValue::Array(to_double(a)?),
            ColumnarValue::Scalar(s) => {
                let a = to_double(&s.to_array()?)?;
                ColumnarValue::Scalar(ScalarValue::try_from_array(&a, 0)?)
            }
        })
    }
}

/// `array` as `Float64`, as `CAST(array AS DOUBLE)` computes it.
pub fn to_double(array: &ArrayRef) -> Result<ArrayRef> {
    match array.data_type() {
        // Arrays do not enforce their declared precision: a value outside i64 goes through
        // CAST with the rest of its array (checked in one pass, so the loop below stays
        // free of branches: a branch per value cost all of the gain).
        DataType::Decimal128(precision, scale)
            if *precision <= 18 && fits_i64(array.as_primitive::<Decimal128Type>().values()) =>
        {
            let pow = 10_f64.powi(i32::from(*scale));
            let values = array.as_primitive::<Decimal128Type>();
            let out: Float64Array = values.unary(|x| (x as i64) as f64 / pow);
            Ok(Arc::new(out))
        }
        _ => {
            let opts = CastOptions {
                safe: false,
                ..Default::default()
            };
            Ok(cast_with_options(array, &DataType::Float64, &opts)?)
        }
    }
}

fn fits_i64(values: &[i128]) -> bool {
    values.iter().fold(true, |ok, &x| {
        ok & (x >= i128::from(i64::MIN)) & (x <= i128::from(i64::MAX))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Decimal128Array, Int32Array, StringArray};
    use arrow::compute::cast;
    use proptest::prelude::*;

    fn same_as_cast(a: ArrayRef) {
        let want = cast(&a, &DataType::Float64).unwrap();
        let got = to_double(&a).unwrap();
        let (w, g) = (
            want.as_primitive::<arrow::datatypes::Float64Type>(),
            got.as_primitive::<arrow::datatypes::Float64Type>(),
        );
        assert_eq!(w.len(), g.len());
        for i in 0..w.len() {
            assert_eq!(w.is_null(i), g.is_null(i), "null at {i}");
            if !w.is_null(i) {
                assert_eq!(w.value(i).to_bits(), g.value(i).to_bits(), "value {i}");
            }
        }
    }

    proptest! {
        /// Bit for bit what CAST gives, for every decimal of up to 18 digits and any scale.
        #[test]
        fn decimals_cast_exactly_as_cast_does(
            values in proptest::collection::vec(prop::option::of(-999_999_999_999_999_999i128..=999_999_999_999_999_999), 0..50),
            scale in -4i8..=18,
        ) {
            let a = Decimal128Array::from(values).with_precision_and_scale(18, scale).unwrap();
            same_as_cast(Arc::new(a));
        }
    }

    #[test]
    fn wide_decimals_integers_and_bad_strings_go_through_cast() {
        let wide = Decimal128Array::from(vec![Some(10_i128.pow(30) + 7), None, Some(-3)])
            .with_precision_and_scale(38, 4)
            .unwrap();
        same_as_cast(Arc::new(wide));
        // Declared 18 digits, holding a value that is not: converted as CAST converts it.
        let over = Decimal128Array::from(vec![Some(i128::from(i64::MAX) * 4 + 1), Some(5)])
            .with_precision_and_scale(18, 2)
            .unwrap();
        same_as_cast(Arc::new(over));
        same_as_cast(Arc::new(Int32Array::from(vec![Some(1), None, Some(-7)])));
        let bad: ArrayRef = Arc::new(StringArray::from(vec!["1.5", "x"]));
        assert!(
            to_double(&bad).is_err(),
            "CAST of 'x' to DOUBLE is an error"
        );
    }
}
