//! Kubernetes resource quantities (`8Gi`, `500m`, `1e3`, `100`), as integers.

use std::fmt;

/// Why a quantity could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Not a Kubernetes quantity.
    #[error("expected a quantity such as 100, 8Gi or 500m, got {0:?}")]
    Syntax(String),
    /// A valid quantity that does not fit in 64 bits.
    #[error("quantity {0:?} is out of range")]
    Range(String),
    /// A JSON value that is neither a number nor a string.
    #[error("expected a number or a quantity string, got {0}")]
    Type(String),
}

/// A non-negative quantity, held as its value rounded up to a whole unit (as
/// Kubernetes does for integer resources) and in milli-units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Quantity {
    milli: u128,
}

impl Quantity {
    /// A quantity of `value` whole units.
    pub fn from_units(value: u64) -> Self {
        Self {
            milli: u128::from(value) * 1000,
        }
    }

    /// The value in whole units, rounded up.
    pub fn value(&self) -> u64 {
        u64::try_from(self.milli.div_ceil(1000)).unwrap_or(u64::MAX)
    }

    /// The value in milli-units.
    pub fn milli_value(&self) -> u128 {
        self.milli
    }

    /// Parses the Kubernetes quantity syntax: a decimal number and an optional
    /// binary (Ki..Ei), decimal (m, k, M..E) or exponent (e3, E6) suffix.
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let bad = || QuantityError::Syntax(text.to_owned());
        let trimmed = text.trim();
        let digits_end = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
            .unwrap_or(trimmed.len());
        let (number, suffix) = trimmed.split_at(digits_end);
        let number = number.strip_prefix('+').unwrap_or(number);
        if number.is_empty() || number.matches('.').count() > 1 || number == "." {
            return Err(bad());
        }
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
        {
            return Err(bad());
        }
        // Scale as (multiplier, decimal exponent) applied to milli-units.
        let (multiplier, exponent): (u128, i32) = match suffix {
            "" => (1, 0),
            "Ki" => (1 << 10, 0),
            "Mi" => (1 << 20, 0),
            "Gi" => (1 << 30, 0),
            "Ti" => (1 << 40, 0),
            "Pi" => (1 << 50, 0),
            "Ei" => (1 << 60, 0),
            "n" => (1, -9),
            "u" => (1, -6),
            "m" => (1, -3),
            "k" => (1, 3),
            "M" => (1, 6),
            "G" => (1, 9),
            "T" => (1, 12),
            "P" => (1, 15),
            "E" => (1, 18),
            exp if exp.starts_with(['e', 'E']) => {
                let value: i32 = exp[1..].parse().map_err(|_| bad())?;
                (1, value)
            }
            _ => return Err(bad()),
        };
        let range = || QuantityError::Range(text.to_owned());
        // mantissa = whole.fraction as an integer, scaled down by 10^len(fraction)
        let mantissa: u128 = format!("{whole}{fraction}")
            .trim_start_matches('0')
            .parse()
            .unwrap_or(0);
        let scale = exponent + 3 - i32::try_from(fraction.len()).map_err(|_| range())?;
        let scaled = mantissa.checked_mul(multiplier).ok_or_else(range)?;
        let milli = if scale >= 0 {
            scaled
                .checked_mul(10u128.checked_pow(scale.unsigned_abs()).ok_or_else(range)?)
                .ok_or_else(range)?
        } else {
            let divisor = 10u128.checked_pow(scale.unsigned_abs()).ok_or_else(range)?;
            scaled.div_ceil(divisor)
        };
        if milli > u128::from(u64::MAX) * 1000 {
            return Err(range());
        }
        Ok(Self { milli })
    }

    /// Reads a quantity from JSON: a non-negative number or a quantity string.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, QuantityError> {
        match value {
            serde_json::Value::Number(number) => Self::parse(&number.to_string()),
            serde_json::Value::String(text) => Self::parse(text),
            other => Err(QuantityError::Type(other.to_string())),
        }
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.milli % 1000 == 0 {
            write!(f, "{}", self.milli / 1000)
        } else {
            write!(f, "{}m", self.milli)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubernetes_quantities() {
        assert_eq!(Quantity::parse("8Gi").map(|q| q.value()), Ok(8 << 30));
        assert_eq!(Quantity::parse("100").map(|q| q.value()), Ok(100));
        assert_eq!(Quantity::parse("1.5Gi").map(|q| q.value()), Ok(3 << 29));
        assert_eq!(Quantity::parse("500m").map(|q| q.milli_value()), Ok(500));
        assert_eq!(Quantity::parse("500m").map(|q| q.value()), Ok(1));
        assert_eq!(Quantity::parse("1e3").map(|q| q.value()), Ok(1000));
        assert_eq!(
            Quantity::parse("16G").map(|q| q.value()),
            Ok(16_000_000_000)
        );
        assert_eq!(Quantity::parse("0").map(|q| q.value()), Ok(0));
        assert_eq!(Quantity::parse("+7").map(|q| q.value()), Ok(7));
    }

    #[test]
    fn rejects_what_is_not_a_quantity() {
        for bad in ["", "x", "-1", "1.2.3", "8GB", "Gi", "1 Gi", "."] {
            assert!(Quantity::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(matches!(
            Quantity::parse("99999999999999999999Ei"),
            Err(QuantityError::Range(_))
        ));
        assert!(matches!(
            Quantity::from_json(&serde_json::json!(true)),
            Err(QuantityError::Type(_))
        ));
        assert!(Quantity::from_json(&serde_json::json!(-5)).is_err());
    }

    #[test]
    fn display_roundtrips() {
        for text in ["8589934592", "500m", "0"] {
            let q = Quantity::parse(text).expect("valid");
            assert_eq!(Quantity::parse(&q.to_string()), Ok(q));
        }
    }

    proptest::proptest! {
        #[test]
        fn never_panics(text in "\\PC{0,16}") {
            let _ = Quantity::parse(&text);
        }

        #[test]
        fn integers_roundtrip(value in 0u64..u64::MAX / 2) {
            proptest::prop_assert_eq!(Quantity::parse(&value.to_string()).map(|q| q.value()), Ok(value));
        }
    }
}
