//! Reading one Megatron-style JSONL line: a JSON object whose `--json-keys` fields are text.
//!
//! Only the requested keys are materialised (borrowed from the line when they contain no
//! escapes); every other value is validated and skipped without allocation.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Why a line is not a valid document.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// The bytes are not UTF-8.
    #[error("invalid UTF-8 at byte {column} of the line")]
    InvalidUtf8 {
        /// 1-based byte column of the first invalid byte.
        column: usize,
    },
    /// Not parseable JSON (this includes an escaped lone surrogate such as `"\ud800"`).
    #[error("invalid JSON at column {column}: {message}")]
    InvalidJson {
        /// 1-based column where parsing failed.
        column: usize,
        /// serde_json's description.
        message: String,
    },
    /// Valid JSON, but not an object.
    #[error("expected a JSON object per line, found {0}")]
    NotAnObject(&'static str),
    /// The object has no such key.
    #[error("missing key {0:?} (set the keys to read with --json-keys)")]
    MissingKey(String),
    /// The key's value is not a string.
    #[error("the value of key {key:?} is {found}, expected a string")]
    NotAString {
        /// The key.
        key: String,
        /// What it held.
        found: &'static str,
    },
    /// The tokenizer rejected the text.
    #[error("{0}")]
    Tokenizer(String),
}

/// Returns the text of each key in `keys` from one line (without its `\n`), or `None` for a
/// blank line, which is not a document.
pub fn parse_line<'a>(
    line: &'a [u8],
    keys: &[String],
) -> Result<Option<Vec<Cow<'a, str>>>, LineError> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.iter().all(|b| matches!(b, b' ' | b'\t' | b'\r')) {
        return Ok(None);
    }
    let text = std::str::from_utf8(line).map_err(|e| LineError::InvalidUtf8 {
        column: e.valid_up_to() + 1,
    })?;
    let mut de = serde_json::Deserializer::from_str(text);
    let fields = FieldsSeed { keys }
        .deserialize(&mut de)
        .map_err(json_error)?;
    de.end().map_err(json_error)?;
    let values = match fields {
        Fields::Object(values) => values,
        Fields::NotAnObject(kind) => return Err(LineError::NotAnObject(kind)),
    };
    values
        .into_iter()
        .zip(keys)
        .map(|(value, key)| match value {
            Field::Missing => Err(LineError::MissingKey(key.clone())),
            Field::NotText(found) => Err(LineError::NotAString {
                key: key.clone(),
                found,
            }),
            Field::Text(text) => Ok(text),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn json_error(e: serde_json::Error) -> LineError {
    let full = e.to_string();
    let message = match full.rsplit_once(" at line ") {
        Some((m, _)) => m.to_owned(),
        None => full,
    };
    LineError::InvalidJson {
        column: e.column(),
        message,
    }
}

enum Fields<'de> {
    Object(Vec<Field<'de>>),
    NotAnObject(&'static str),
}

#[derive(Clone)]
enum Field<'de> {
    Missing,
    Text(Cow<'de, str>),
    NotText(&'static str),
}

struct FieldsSeed<'k> {
    keys: &'k [String],
}

impl<'de> DeserializeSeed<'de> for FieldsSeed<'_> {
    type Value = Fields<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldsSeed<'_> {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut values = vec![Field::Missing; self.keys.len()];
        while let Some(key) = map.next_key::<Text<'de>>()? {
            let key = match key.0 {
                Ok(k) => k,
                Err(_) => unreachable!("JSON object keys are strings"),
            };
            match self.keys.iter().position(|k| *k == *key) {
                Some(i) => {
                    // Duplicate keys: the last one wins, as in Python's json.loads.
                    values[i] = match map.next_value::<Text<'de>>()?.0 {
                        Ok(text) => Field::Text(text),
                        Err(kind) => Field::NotText(kind),
                    };
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Fields::Object(values))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Fields::NotAnObject("an array"))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Fields::NotAnObject("a boolean"))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Fields::NotAnObject("a number"))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Fields::NotAnObject("a number"))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Fields::NotAnObject("a number"))
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Fields::NotAnObject("a string"))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Fields::NotAnObject("null"))
    }
}

/// A JSON value that is kept if it is a string (borrowed when possible) and otherwise
/// skipped, remembering what kind of value it was.
struct Text<'de>(Result<Cow<'de, str>, &'static str>);

impl<'de> serde::Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TextVisitor)
    }
}

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Text(Ok(Cow::Borrowed(v))))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Text(Ok(Cow::Owned(v.to_owned()))))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Text(Ok(Cow::Owned(v))))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Text(Err("a boolean")))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Text(Err("a number")))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Text(Err("a number")))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Text(Err("a number")))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Text(Err("null")))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Text(Err("an array")))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Text(Err("an object")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn reads_requested_keys_and_reports_each_kind_of_bad_line() {
        let k = keys(&["text"]);
        let ok = parse_line(br#"{"id": 3, "text": "a\nb", "x": [1, {"y": null}]}"#, &k)
            .unwrap()
            .unwrap();
        assert_eq!(ok, vec![Cow::Borrowed("a\nb")]);
        assert_eq!(parse_line(b"  \r", &k).unwrap(), None);
        assert!(matches!(
            parse_line(b"{\"text\": 1}", &k),
            Err(LineError::NotAString {
                found: "a number",
                ..
            })
        ));
        assert!(matches!(
            parse_line(b"{\"txt\": \"a\"}", &k),
            Err(LineError::MissingKey(_))
        ));
        assert!(matches!(
            parse_line(b"[1, 2]", &k),
            Err(LineError::NotAnObject("an array"))
        ));
        assert!(matches!(
            parse_line(b"{\"text\": \"a\"", &k),
            Err(LineError::InvalidJson { .. })
        ));
        assert!(matches!(
            parse_line(b"{\"text\": \"a\"} x", &k),
            Err(LineError::InvalidJson { .. })
        ));
        assert!(matches!(
            parse_line(b"{\"text\": \"\xff\"}", &k),
            Err(LineError::InvalidUtf8 { column: 11 })
        ));
        match parse_line(br#"{"text": "\ud800"}"#, &k) {
            Err(LineError::InvalidJson { message, .. }) => {
                assert!(message.contains("surrogate"), "{message}")
            }
            other => panic!("lone surrogate accepted: {other:?}"),
        }
        let dup = parse_line(br#"{"text": "a", "text": "b"}"#, &k)
            .unwrap()
            .unwrap();
        assert_eq!(dup, vec![Cow::Borrowed("b")]);
    }
}
