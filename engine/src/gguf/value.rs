//! GGUF metadata values and the key-value store.
//!
//! Source: the GGUF specification, "Standardized key-value pairs" and `gguf_metadata_value_type`
//! (ggml/docs/gguf.md). Arrays are typed and may nest.

use std::collections::BTreeMap;
use std::fmt;

/// The type tag of a metadata value, as stored (as a `u32`) in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with tag `id`, or `None` when the tag is unknown.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Encoded size in bytes of a scalar of this type; `None` for strings and arrays.
    pub fn scalar_bytes(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }
}

/// One metadata value. Arrays keep their element type so that an empty array round-trips.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value's type tag.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value that fits in a `u64` (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value as an `i64` (a `u64` above `i64::MAX` does not fit).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v as i64),
            Value::U16(v) => Some(v as i64),
            Value::U32(v) => Some(v as i64),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// A float or integer value as an `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A boolean value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The items of an array value.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// The value as JSON (arrays as JSON arrays, non-finite floats as `null`).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::String(s) => J::String(s.clone()),
            Value::Bool(b) => J::Bool(*b),
            Value::F32(v) => serde_json::Number::from_f64(*v as f64).map_or(J::Null, J::Number),
            Value::F64(v) => serde_json::Number::from_f64(*v).map_or(J::Null, J::Number),
            Value::Array(_, items) => J::Array(items.iter().map(Value::to_json).collect()),
            Value::U64(v) => J::from(*v),
            other => J::from(other.as_i64().expect("remaining variants are integers")),
        }
    }
}

impl fmt::Display for Value {
    /// Scalars print as themselves; arrays longer than 8 items print their length and first items.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(ty, items) => {
                write!(f, "[{ty:?}; {}]", items.len())?;
                if !items.is_empty() {
                    f.write_str(" [")?;
                    for (i, item) in items.iter().take(8).enumerate() {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        write!(f, "{item}")?;
                    }
                    f.write_str(if items.len() > 8 { ", ...]" } else { "]" })?;
                }
                Ok(())
            }
            Value::F32(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            other => write!(
                f,
                "{}",
                other.as_i64().map_or_else(|| format!("{other:?}"), |v| v.to_string())
            ),
        }
    }
}

/// A metadata lookup that failed: the key is absent or holds another type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MetadataError {
    #[error("metadata key `{key}` is missing")]
    Missing { key: String },
    #[error("metadata key `{key}` holds {found:?}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: ValueType,
    },
}

/// The key-value metadata of a GGUF model, in file order.
///
/// Typed getters return [`MetadataError`] naming the key; callers add the file name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: BTreeMap<String, usize>,
}

impl Metadata {
    /// An empty store.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Sets `key` to `value`, replacing an earlier value (which keeps its position).
    pub fn insert(&mut self, key: impl Into<String>, value: Value) {
        let key = key.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// All entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn required(&self, key: &str) -> Result<&Value, MetadataError> {
        self.get(key)
            .ok_or_else(|| MetadataError::Missing { key: key.to_string() })
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<T, MetadataError> {
        let v = self.required(key)?;
        f(v).ok_or_else(|| MetadataError::WrongType {
            key: key.to_string(),
            expected,
            found: v.value_type(),
        })
    }

    /// An integer value as `u64` (any integer type; negative values are a type error).
    pub fn get_u64(&self, key: &str) -> Result<u64, MetadataError> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    /// An integer value as `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, MetadataError> {
        self.typed(key, "an integer that fits u32", |v| {
            v.as_u64().and_then(|v| u32::try_from(v).ok())
        })
    }

    /// A float or integer value as `f32`.
    pub fn get_f32(&self, key: &str) -> Result<f32, MetadataError> {
        self.typed(key, "a number", |v| v.as_f64().map(|v| v as f32))
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<bool, MetadataError> {
        self.typed(key, "a bool", Value::as_bool)
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, MetadataError> {
        self.typed(key, "a string", Value::as_str)
    }

    /// An array value's items.
    pub fn get_array(&self, key: &str) -> Result<&[Value], MetadataError> {
        self.typed(key, "an array", Value::as_array)
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, MetadataError> {
        self.typed(key, "an array of strings", |v| {
            v.as_array()?.iter().map(Value::as_str).collect()
        })
    }

    /// `general.architecture`, the prefix of the model's hyper-parameter keys (`llama`, `qwen3moe`...).
    pub fn architecture(&self) -> Result<&str, MetadataError> {
        self.get_str("general.architecture")
    }

    /// `general.alignment`, defaulting to 32 as the spec says.
    pub fn alignment(&self) -> Result<u64, MetadataError> {
        if self.contains("general.alignment") {
            self.get_u64("general.alignment")
        } else {
            Ok(32)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_getters_name_the_key() {
        let mut m = Metadata::new();
        m.insert("a.n", Value::U32(7));
        m.insert("a.s", Value::String("x".into()));
        m.insert("a.neg", Value::I32(-1));
        assert_eq!(m.get_u64("a.n"), Ok(7));
        assert_eq!(m.get_f32("a.n"), Ok(7.0));
        assert_eq!(m.get_str("a.s"), Ok("x"));
        assert_eq!(
            m.get_u32("missing"),
            Err(MetadataError::Missing { key: "missing".into() })
        );
        let err = m.get_u64("a.neg").unwrap_err().to_string();
        assert!(err.contains("a.neg") && err.contains("I32"), "{err}");
        assert_eq!(m.alignment(), Ok(32));
    }

    #[test]
    fn insert_replaces_in_place() {
        let mut m = Metadata::new();
        m.insert("k1", Value::U8(1));
        m.insert("k2", Value::U8(2));
        m.insert("k1", Value::U8(3));
        let keys: Vec<_> = m.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        assert_eq!(keys, vec![("k1".into(), Value::U8(3)), ("k2".into(), Value::U8(2))]);
    }
}
