//! Megatron's per-layer patterns (`--window-attn-skip-freq`, and the MoE and no-RoPE layer
//! frequencies): a Python list expression such as `([1]*3+[0]*1)*3`, which Megatron `eval`s.
//! Only that expression's grammar is read here, lists of integers joined by `+` and repeated
//! by `*` with parentheses, so a pattern means what it means to Megatron and nothing else
//! runs.

/// The entries of `text`, or what is wrong with it (at which character).
pub fn parse_layer_pattern(text: &str) -> Result<Vec<i64>, String> {
    let mut parser = Parser {
        chars: text.chars().filter(|c| !c.is_whitespace()).collect(),
        at: 0,
    };
    let entries = parser.sum()?;
    match parser.peek() {
        None => Ok(entries),
        Some(c) => Err(parser.error(&format!("unexpected {c:?}"))),
    }
}

/// A cursor over the pattern's characters (whitespace removed).
struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn error(&self, what: &str) -> String {
        format!(
            "{what} at character {} (expected lists of integers, `+`, `*`, parentheses)",
            self.at + 1
        )
    }

    fn eat(&mut self, c: char) -> bool {
        let found = self.peek() == Some(c);
        self.at += usize::from(found);
        found
    }

    /// `product (+ product)*`: the lists concatenated.
    fn sum(&mut self) -> Result<Vec<i64>, String> {
        let mut entries = self.product()?;
        while self.eat('+') {
            entries.extend(self.product()?);
        }
        Ok(entries)
    }

    /// `atom (* count)*`: the list repeated.
    fn product(&mut self) -> Result<Vec<i64>, String> {
        let mut entries = self.atom()?;
        while self.eat('*') {
            let count = self.integer()?;
            let count = usize::try_from(count).map_err(|_| self.error("a negative repeat"))?;
            entries = entries.repeat(count);
        }
        Ok(entries)
    }

    /// `[integers]` or `(sum)`.
    fn atom(&mut self) -> Result<Vec<i64>, String> {
        if self.eat('(') {
            let entries = self.sum()?;
            return match self.eat(')') {
                true => Ok(entries),
                false => Err(self.error("an unclosed parenthesis")),
            };
        }
        if !self.eat('[') {
            return Err(self.error("no list"));
        }
        let mut entries = Vec::new();
        if self.eat(']') {
            return Ok(entries);
        }
        loop {
            entries.push(self.integer()?);
            if self.eat(']') {
                return Ok(entries);
            }
            if !self.eat(',') {
                return Err(self.error("an unclosed list"));
            }
        }
    }

    fn integer(&mut self) -> Result<i64, String> {
        let start = self.at;
        self.eat('-');
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
        let digits: String = self.chars[start..self.at].iter().collect();
        digits.parse().map_err(|_| {
            self.at = start;
            self.error("no integer")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::parse_layer_pattern;

    /// The patterns of Megatron's help texts, with the lists Python's `eval` gives them.
    #[test]
    fn megatrons_examples_read_as_python_evaluates_them() {
        let cases: [(&str, Vec<i64>); 4] = [
            ("([1]*3+[0]*1)*3", vec![1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0]),
            ("([0]+[1]*23)", [vec![0], vec![1; 23]].concat()),
            ("([1]*3+[0]*2)*2", vec![1, 1, 1, 0, 0, 1, 1, 1, 0, 0]),
            ("[1, 0, 1]", vec![1, 0, 1]),
        ];
        for (text, want) in cases {
            assert_eq!(parse_layer_pattern(text).unwrap(), want, "{text}");
        }
    }

    #[test]
    fn anything_else_is_refused_with_where() {
        for text in ["[1,0", "([1]*3", "[1]*x", "__import__('os')", "[1]+"] {
            let err = parse_layer_pattern(text).unwrap_err();
            assert!(err.contains("at character"), "{text}: {err}");
        }
    }
}
