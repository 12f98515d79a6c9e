//! Megatron's zero-shot detokenizers (`tasks/zeroshot_gpt/detokenizer.py`): WikiText and PTB are
//! published pre-tokenized (`don 't`, `1 @,@ 000`); they are turned back into ordinary text
//! before a BPE tokenizer sees them, and the perplexity is then adjusted by the token ratio.

use std::path::Path;
use std::sync::LazyLock;

use fancy_regex::Regex;

/// One of Megatron's detokenizers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detokenizer {
    /// Penn Treebank's conventions.
    Ptb,
    /// WikiText's (`@-@`, spaced punctuation, `= = heading = =`).
    Wikitext,
    /// LAMBADA's text is plain: the identity.
    Lambada,
}

impl std::str::FromStr for Detokenizer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ptb" => Ok(Self::Ptb),
            "wikitext" | "wiki" => Ok(Self::Wikitext),
            "lambada" | "none" => Ok(Self::Lambada),
            other => Err(format!(
                "unknown detokenizer {other:?}: expected wikitext, ptb or none"
            )),
        }
    }
}

impl Detokenizer {
    /// Megatron's choice: the first of `ptb`, `wiki`, `lambada` that occurs in the file's path.
    pub fn for_path(path: &Path) -> Option<Self> {
        let path = path.to_string_lossy();
        [
            ("ptb", Self::Ptb),
            ("wiki", Self::Wikitext),
            ("lambada", Self::Lambada),
        ]
        .into_iter()
        .find(|(key, _)| path.contains(key))
        .map(|(_, detokenizer)| detokenizer)
    }

    /// The detokenized text.
    pub fn apply(self, text: &str) -> String {
        match self {
            Self::Ptb => ptb(text),
            Self::Wikitext => wikitext(text),
            Self::Lambada => text.to_string(),
        }
    }
}

fn replace_all(text: &str, pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .fold(text.to_string(), |s, (from, to)| s.replace(from, to))
}

fn ptb(text: &str) -> String {
    replace_all(
        text,
        &[
            (" '", "'"),
            (" \n", "\n"),
            ("\n ", "\n"),
            (" n't", "n't"),
            (" N ", "1 "),
            ("$ 1", "$1"),
            ("# 1", "#1"),
        ],
    )
}

/// Megatron's regular expressions, in its order, with Python's `\1` as `$1`.
static WIKITEXT_BRACKETS: LazyLock<Vec<(Regex, &str)>> = LazyLock::new(|| {
    [
        (r"\(\s*([^\)]*?)\s*\)", "($1)"),
        (r"\[\s*([^\]]*?)\s*\]", "[$1]"),
        (r"{\s*([^}]*?)\s*}", "{$1}"),
        (r#""\s*([^"]*?)\s*""#, "\"$1\""),
        (r"'\s*([^']*?)\s*'", "'$1'"),
    ]
    .into_iter()
    .map(|(pattern, replacement)| (Regex::new(pattern).expect("valid pattern"), replacement))
    .collect()
});

static WIKITEXT_QUOTED_DIGIT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"/' [0-9]/").expect("valid pattern"));

fn wikitext(text: &str) -> String {
    let s = text.replace("s '", "s'");
    let s = WIKITEXT_QUOTED_DIGIT
        .replace_all(&s, "/'[0-9]/")
        .into_owned();
    let mut s = replace_all(
        &s,
        &[
            (" @-@ ", "-"),
            (" @,@ ", ","),
            (" @.@ ", "."),
            (" : ", ": "),
            (" ; ", "; "),
            (" . ", ". "),
            (" ! ", "! "),
            (" ? ", "? "),
            (" , ", ", "),
        ],
    );
    for (pattern, replacement) in WIKITEXT_BRACKETS.iter() {
        s = pattern.replace_all(&s, *replacement).into_owned();
    }
    replace_all(
        &s,
        &[
            ("= = = =", "===="),
            ("= = =", "==="),
            ("= =", "=="),
            (" \u{b0} ", "\u{b0}"),
            (" \n", "\n"),
            ("\n ", "\n"),
            (" N ", " 1 "),
            (" 's", "'s"),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected strings printed by Megatron's `wikitext_detokenizer` / `ptb_detokenizer`
    /// (Python 3.11).
    #[test]
    fn detokenizers_give_megatrons_text() {
        let raw = " = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) , commonly referred to as \" Valkyria Chronicles III \" outside Japan , is a 1 @,@ 000 @-@ year old ' tactical ' game at 25 @.@ 5 ° C . Players ' units don 't , [ a ] { b } = = = Gameplay = = = \n";
        assert_eq!(
            Detokenizer::Wikitext.apply(raw),
            " = Valkyria Chronicles III =\n\nSenjō no Valkyria 3: <unk> Chronicles (Japanese: 戦場のヴァルキュリア3, lit. Valkyria of the Battlefield 3), commonly referred to as \"Valkyria Chronicles III\" outside Japan, is a 1,000-year old 'tactical' game at 25.5°C. Players'units don't, [a] {b} === Gameplay ===\n"
        );
        assert_eq!(
            Detokenizer::Ptb.apply("the company 's N shares do n't cost $ 1 \n more"),
            "the company's1 shares don't cost $1\nmore"
        );
    }

    #[test]
    fn the_path_chooses_as_in_megatron() {
        let choose = |p: &str| Detokenizer::for_path(Path::new(p));
        assert_eq!(
            choose("data/wikitext-103/wiki.test.tokens"),
            Some(Detokenizer::Wikitext)
        );
        assert_eq!(choose("ptb/ptb.test.txt"), Some(Detokenizer::Ptb));
        assert_eq!(choose("lambada_test.jsonl"), Some(Detokenizer::Lambada));
        assert_eq!(choose("eval/text.txt"), None);
    }
}
