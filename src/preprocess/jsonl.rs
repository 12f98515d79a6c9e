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
    /// Not parseable JSON.
    #[error("invalid JSON at column {column}: {message}")]
    InvalidJson {
        /// 1-based column where parsing failed.
        column: usize,
        /// serde_json's description.
        message: String,
    },
    /// A `\uXXXX` escape of half a surrogate pair with no other half: not a character,
    /// so not text (Python's json accepts it; Megatron then fails to encode it).
    #[error("escaped lone surrogate {escape} at column {column}: not valid Unicode text")]
    LoneSurrogate {
        /// The escape as written.
        escape: String,
        /// 1-based column of its backslash.
        column: usize,
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
        .and_then(|fields| de.end().map(|()| fields))
        .map_err(|e| find_lone_surrogate(line).unwrap_or_else(|| json_error(e)))?;
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

/// Finds the first `\uD800`–`\uDFFF` escape that is not half of a valid pair; called only
/// after parsing failed, to name the problem in words users recognise.
fn find_lone_surrogate(line: &[u8]) -> Option<LineError> {
    let hex4 = |at: usize| -> Option<u32> {
        let digits = std::str::from_utf8(line.get(at..at + 4)?).ok()?;
        u32::from_str_radix(digits, 16).ok()
    };
    let mut i = 0;
    while i + 1 < line.len() {
        if line[i] != b'\\' {
            i += 1;
            continue;
        }
        if line[i + 1] != b'u' {
            i += 2;
            continue;
        }
        let unit = hex4(i + 2)?;
        let paired = (0xD800..0xDC00).contains(&unit)
            && line.get(i + 6..i + 8) == Some(b"\\u")
            && hex4(i + 8).is_some_and(|low| (0xDC00..0xE000).contains(&low));
        if paired {
            i += 12;
        } else if (0xD800..0xE000).contains(&unit) {
            let escape = String::from_utf8_lossy(&line[i..i + 6]).into_owned();
            return Some(LineError::LoneSurrogate {
                escape,
                column: i + 1,
            });
        } else {
            i += 6;
        }
    }
    None
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
        for (line, column) in [
            (&br#"{"text": "\ud800"}"#[..], 11),
            (br#"{"text": "a\ud800b"}"#, 12),
            (br#"{"text": "\udc00 x"}"#, 11),
            (br#"{"text": "\ud83d\ude00 \\u \ud800\u0041"}"#, 28),
        ] {
            match parse_line(line, &k) {
                Err(LineError::LoneSurrogate { column: c, .. }) => assert_eq!(c, column),
                other => panic!("lone surrogate not reported: {other:?}"),
            }
        }
        // A proper pair is one character.
        let pair = parse_line(br#"{"text": "\ud83d\ude00"}"#, &k)
            .unwrap()
            .unwrap();
        assert_eq!(pair, vec![Cow::<str>::Owned("😀".into())]);
        let dup = parse_line(br#"{"text": "a", "text": "b"}"#, &k)
            .unwrap()
            .unwrap();
        assert_eq!(dup, vec![Cow::Borrowed("b")]);
    }
}
