//! The plain-data side of a Python pickle, for what `pytorch-reader` leaves out: the
//! arguments Megatron saves beside its weights.
//!
//! A Megatron checkpoint's `args` is an `argparse.Namespace`, which a pickle spells as a
//! class, an empty `NEWOBJ` and a `BUILD` with the attribute dict. `pytorch-reader` (which
//! reads the tensors) keeps only the type name of such an object, and `serde-pickle` keeps its
//! state but refuses the persistent ids every tensor is written with; neither reads the
//! namespace out of a `model_optim_rng.pt`. This reader interprets no call: a class
//! instance or a call's result is its type name with its arguments and the state `BUILD`
//! gave it, a persistent id (a tensor's storage) the id. The tensors of a checkpoint file stay
//! `pytorch-reader`'s job; `torch_dist`'s metadata and single-tensor items are read with this.
//! Protocols 2 to 5 as `torch.save` writes them; every opcode outside that set is an error
//! naming it, never a guess.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

/// A value read back from a pickle (what [`super::torch_save::PyValue`] is to the writer).
#[derive(Clone, Debug, PartialEq)]
pub enum Unpickled {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Unpickled>),
    Tuple(Vec<Unpickled>),
    /// Keys in the pickle's order (they may be ints: an optimizer's state).
    Dict(Vec<(Unpickled, Unpickled)>),
    /// A module-level name (`argparse.Namespace`, `torch.bfloat16`).
    Global(String),
    /// The result of calling or instantiating `class` with `args`, with the state `BUILD` set
    /// on it (`None` without one).
    Object {
        class: String,
        args: Box<Unpickled>,
        state: Box<Unpickled>,
    },
    /// A persistent id (in a `torch.save` file, a tensor's storage: `('storage', class, key,
    /// location, numel)`).
    Persistent(Box<Unpickled>),
}

impl Unpickled {
    /// The value under the string key `key` of a dict (or of an object's state dict).
    pub fn get(&self, key: &str) -> Option<&Unpickled> {
        match self {
            Unpickled::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Unpickled::Str(s) if s == key))
                .map(|(_, v)| v),
            Unpickled::Object { state, .. } => state.get(key),
            _ => None,
        }
    }

    /// The string-keyed entries of a dict, or of an object's state dict.
    pub fn attributes(&self) -> HashMap<String, Unpickled> {
        match self {
            Unpickled::Dict(items) => items
                .iter()
                .filter_map(|(k, v)| match k {
                    Unpickled::Str(s) => Some((s.clone(), v.clone())),
                    _ => None,
                })
                .collect(),
            Unpickled::Object { state, .. } => state.attributes(),
            _ => HashMap::new(),
        }
    }

    /// Nodes in the value, for bounding what memo copies may cost.
    fn size(&self) -> usize {
        match self {
            Unpickled::List(v) | Unpickled::Tuple(v) => {
                1 + v.iter().map(Unpickled::size).sum::<usize>()
            }
            Unpickled::Dict(items) => {
                1 + items
                    .iter()
                    .map(|(k, v)| k.size() + v.size())
                    .sum::<usize>()
            }
            Unpickled::Object { args, state, .. } => 1 + args.size() + state.size(),
            Unpickled::Persistent(id) => 1 + id.size(),
            Unpickled::Str(s) => 1 + s.len() / 64,
            Unpickled::Bytes(b) => 1 + b.len() / 64,
            _ => 1,
        }
    }
}

/// The pickle `data.pkl` inside the `torch.save` zip at `file` (whatever its root folder).
pub fn read_torch_save_pickle(file: &Path) -> Result<Unpickled> {
    let opened =
        std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
    let mut archive = zip::ZipArchive::new(std::io::BufReader::new(opened))
        .with_context(|| format!("{}: not a torch.save zip", file.display()))?;
    let name = archive
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .find(|n| n == "data.pkl" || n.ends_with("/data.pkl"))
        .with_context(|| format!("{}: the zip holds no data.pkl", file.display()))?;
    let mut bytes = Vec::new();
    archive
        .by_name(&name)
        .and_then(|mut entry| Ok(entry.read_to_end(&mut bytes)?))
        .with_context(|| format!("{}: reading {name}", file.display()))?;
    parse_pickle(&bytes).with_context(|| format!("{}: {name}", file.display()))
}

/// The most nodes memo copies may create: far beyond a checkpoint's metadata, far below
/// what a pickle built to multiply itself through its memo would need.
const COPY_BUDGET: usize = 50_000_000;

/// One stack entry: a value, the memo slot it was stored in (refreshed when the value is
/// mutated after being stored), or a mark.
enum Entry {
    Value(Unpickled, Option<u32>),
    Mark,
}

/// The pickle machine's state.
struct Machine<'a> {
    bytes: &'a [u8],
    at: usize,
    stack: Vec<Entry>,
    memo: HashMap<u32, Unpickled>,
    copies: usize,
}

/// Runs the pickle in `bytes` to its `STOP` and returns the value it leaves.
pub fn parse_pickle(bytes: &[u8]) -> Result<Unpickled> {
    let mut machine = Machine {
        bytes,
        at: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        copies: 0,
    };
    loop {
        let offset = machine.at;
        let op = machine.take(1)?[0];
        if op == b'.' {
            return machine.pop();
        }
        machine
            .step(op)
            .with_context(|| format!("pickle opcode {op:#04x} at byte {offset}"))?;
    }
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        ensure!(
            self.at + n <= self.bytes.len(),
            "the pickle ends inside an opcode (byte {})",
            self.bytes.len()
        );
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<usize> {
        Ok(self.take(1)?[0] as usize)
    }

    fn u32(&mut self) -> Result<usize> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn u64(&mut self) -> Result<usize> {
        let b = self.take(8)?;
        let n = u64::from_le_bytes(b.try_into().expect("8 bytes"));
        usize::try_from(n).context("a length past this machine's addresses")
    }

    fn line(&mut self) -> Result<String> {
        let rest = &self.bytes[self.at..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .context("a text argument without its newline")?;
        let text = String::from_utf8_lossy(&rest[..end]).into_owned();
        self.at += end + 1;
        Ok(text)
    }

    fn text(&mut self, n: usize) -> Result<Unpickled> {
        let bytes = self.take(n)?;
        Ok(Unpickled::Str(
            std::str::from_utf8(bytes)
                .context("a string that is not UTF-8")?
                .to_owned(),
        ))
    }

    fn bytes_value(&mut self, n: usize) -> Result<Unpickled> {
        Ok(Unpickled::Bytes(self.take(n)?.to_vec()))
    }

    fn push(&mut self, value: Unpickled) {
        self.stack.push(Entry::Value(value, None));
    }

    fn pop_entry(&mut self) -> Result<(Unpickled, Option<u32>)> {
        match self.stack.pop() {
            Some(Entry::Value(v, slot)) => Ok((v, slot)),
            Some(Entry::Mark) => bail!("a mark where a value was expected"),
            None => bail!("the stack is empty"),
        }
    }

    fn pop(&mut self) -> Result<Unpickled> {
        self.pop_entry().map(|(v, _)| v)
    }

    fn pop_to_mark(&mut self) -> Result<Vec<Unpickled>> {
        let mut items = Vec::new();
        loop {
            match self.stack.pop() {
                Some(Entry::Value(v, _)) => items.push(v),
                Some(Entry::Mark) => break,
                None => bail!("no mark on the stack"),
            }
        }
        items.reverse();
        Ok(items)
    }

    /// Applies `change` to the value on top of the stack, and to its memo copy.
    fn mutate_top(&mut self, change: impl FnOnce(&mut Unpickled) -> Result<()>) -> Result<()> {
        let (mut value, slot) = self.pop_entry()?;
        change(&mut value)?;
        if let Some(slot) = slot {
            self.charge(&value)?;
            self.memo.insert(slot, value.clone());
        }
        self.stack.push(Entry::Value(value, slot));
        Ok(())
    }

    fn charge(&mut self, value: &Unpickled) -> Result<()> {
        self.copies += value.size();
        ensure!(
            self.copies <= COPY_BUDGET,
            "the pickle's memo copies exceed {COPY_BUDGET} nodes"
        );
        Ok(())
    }

    fn memo_put(&mut self, slot: u32) -> Result<()> {
        let Some(Entry::Value(value, memo_slot)) = self.stack.last_mut() else {
            bail!("nothing to memoize");
        };
        *memo_slot = Some(slot);
        let value = value.clone();
        self.charge(&value)?;
        self.memo.insert(slot, value);
        Ok(())
    }

    fn memo_get(&mut self, slot: u32) -> Result<()> {
        let value = self
            .memo
            .get(&slot)
            .with_context(|| format!("memo slot {slot} was never stored"))?
            .clone();
        self.charge(&value)?;
        self.stack.push(Entry::Value(value, Some(slot)));
        Ok(())
    }

    /// Executes one opcode (its argument bytes follow it).
    fn step(&mut self, op: u8) -> Result<()> {
        if let Some(value) = self.literal(op)? {
            self.push(value);
            return Ok(());
        }
        if self.stack_op(op)? || self.container_op(op)? || self.memo_op(op)? {
            return Ok(());
        }
        self.object_op(op)
    }

    /// The value an opcode that pushes a constant pushes (`None` for other opcodes).
    fn literal(&mut self, op: u8) -> Result<Option<Unpickled>> {
        Ok(Some(match op {
            b'N' => Unpickled::None,
            0x88 => Unpickled::Bool(true),
            0x89 => Unpickled::Bool(false),
            b'J' => {
                let b: [u8; 4] = self.take(4)?.try_into().expect("4 bytes");
                Unpickled::Int(i32::from_le_bytes(b).into())
            }
            b'K' => Unpickled::Int(self.u8()? as i64),
            b'M' => {
                let b: [u8; 2] = self.take(2)?.try_into().expect("2 bytes");
                Unpickled::Int(u16::from_le_bytes(b).into())
            }
            0x8a => {
                let n = self.u8()?;
                long(self.take(n)?)
            }
            0x8b => {
                let n = self.u32()?;
                long(self.take(n)?)
            }
            b'G' => {
                let b: [u8; 8] = self.take(8)?.try_into().expect("8 bytes");
                Unpickled::Float(f64::from_be_bytes(b))
            }
            b'X' => {
                let n = self.u32()?;
                self.text(n)?
            }
            0x8c => {
                let n = self.u8()?;
                self.text(n)?
            }
            0x8d => {
                let n = self.u64()?;
                self.text(n)?
            }
            b'T' | b'B' => {
                let n = self.u32()?;
                self.bytes_value(n)?
            }
            b'U' | b'C' => {
                let n = self.u8()?;
                self.bytes_value(n)?
            }
            0x8e | 0x96 => {
                let n = self.u64()?;
                self.bytes_value(n)?
            }
            b'}' => Unpickled::Dict(Vec::new()),
            b']' | 0x8f => Unpickled::List(Vec::new()),
            b')' => Unpickled::Tuple(Vec::new()),
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                Unpickled::Global(format!("{module}.{name}"))
            }
            _ => return Ok(None),
        }))
    }

    /// Framing, marks and stack shuffles; whether `op` was one.
    fn stack_op(&mut self, op: u8) -> Result<bool> {
        match op {
            0x80 => drop(self.u8()?),  // PROTO
            0x95 => drop(self.u64()?), // FRAME: framing only
            b'(' => self.stack.push(Entry::Mark),
            b'0' => drop(self.pop_entry()?),
            b'1' => drop(self.pop_to_mark()?),
            b'2' => {
                let (value, _) = self.pop_entry()?;
                self.push(value.clone());
                self.push(value);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Opcodes that build or fill lists, tuples, sets and dicts; whether `op` was one.
    fn container_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b'd' => {
                let items = self.pop_to_mark()?;
                self.push(Unpickled::Dict(pairs(items)?));
            }
            b'l' | 0x91 => {
                let items = self.pop_to_mark()?;
                self.push(Unpickled::List(items));
            }
            b't' => {
                let items = self.pop_to_mark()?;
                self.push(Unpickled::Tuple(items));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = (0..n).map(|_| self.pop()).collect::<Result<Vec<_>>>()?;
                items.reverse();
                self.push(Unpickled::Tuple(items));
            }
            b'a' => {
                let item = self.pop()?;
                self.mutate_top(|list| extend(list, vec![item]))?;
            }
            b'e' | 0x90 => {
                let items = self.pop_to_mark()?;
                self.mutate_top(|list| extend(list, items))?;
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                self.mutate_top(|dict| insert(dict, vec![(key, value)]))?;
            }
            b'u' => {
                let items = pairs(self.pop_to_mark()?)?;
                self.mutate_top(|dict| insert(dict, items))?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The memo's puts and gets; whether `op` was one.
    fn memo_op(&mut self, op: u8) -> Result<bool> {
        match op {
            b'q' => {
                let slot = self.u8()? as u32;
                self.memo_put(slot)?;
            }
            b'r' => {
                let slot = self.u32()? as u32;
                self.memo_put(slot)?;
            }
            0x94 => self.memo_put(self.memo.len() as u32)?,
            b'p' => {
                let slot = self.line()?.parse().context("a PUT slot")?;
                self.memo_put(slot)?;
            }
            b'h' => {
                let slot = self.u8()? as u32;
                self.memo_get(slot)?;
            }
            b'j' => {
                let slot = self.u32()? as u32;
                self.memo_get(slot)?;
            }
            b'g' => {
                let slot = self.line()?.parse().context("a GET slot")?;
                self.memo_get(slot)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Names, calls, instances and their state, persistent ids; any other opcode is an error.
    fn object_op(&mut self, op: u8) -> Result<()> {
        match op {
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module, name) {
                    (Unpickled::Str(module), Unpickled::Str(name)) => {
                        self.push(Unpickled::Global(format!("{module}.{name}")))
                    }
                    _ => bail!("STACK_GLOBAL of names that are not strings"),
                }
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let callable = self.pop()?;
                self.push(instance(callable, args));
            }
            0x92 => {
                drop(self.pop()?); // keyword arguments
                let args = self.pop()?;
                let class = self.pop()?;
                self.push(instance(class, args));
            }
            b'b' => {
                let new_state = self.pop()?;
                self.mutate_top(|object| {
                    build(object, new_state);
                    Ok(())
                })?;
            }
            b'Q' => {
                let id = self.pop()?;
                self.push(Unpickled::Persistent(Box::new(id)));
            }
            _ => bail!("an opcode this reader does not know"),
        }
        Ok(())
    }
}

/// A little-endian two's-complement integer (`LONG1`/`LONG4`), or a float past `i64`.
fn long(bytes: &[u8]) -> Unpickled {
    if bytes.len() <= 8 {
        let fill = if bytes.last().is_some_and(|b| b & 0x80 != 0) {
            0xff
        } else {
            0
        };
        let mut word = [fill; 8];
        word[..bytes.len()].copy_from_slice(bytes);
        return Unpickled::Int(i64::from_le_bytes(word));
    }
    let magnitude = bytes
        .iter()
        .rev()
        .fold(0.0f64, |acc, &b| acc * 256.0 + b as f64);
    let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
    Unpickled::Float(if negative {
        magnitude - 2f64.powi(8 * bytes.len() as i32)
    } else {
        magnitude
    })
}

/// What calling or instantiating `callable` with `args` leaves: an object of its class,
/// without state yet. Nothing is run: the arguments are kept as they are.
fn instance(callable: Unpickled, args: Unpickled) -> Unpickled {
    let class = match callable {
        Unpickled::Global(name) => name,
        Unpickled::Object { class, .. } => class,
        _ => "<call>".to_owned(),
    };
    Unpickled::Object {
        class,
        args: Box::new(args),
        state: Box::new(Unpickled::None),
    }
}

/// `BUILD`: an object takes `new_state` as its state; a dict (an `OrderedDict` with
/// `_metadata`) keeps its items and ignores the attribute.
fn build(object: &mut Unpickled, new_state: Unpickled) {
    if let Unpickled::Object { state, .. } = object {
        **state = new_state;
    }
}

fn pairs(items: Vec<Unpickled>) -> Result<Vec<(Unpickled, Unpickled)>> {
    ensure!(items.len().is_multiple_of(2), "an odd number of dict items");
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

fn extend(list: &mut Unpickled, items: Vec<Unpickled>) -> Result<()> {
    match list {
        Unpickled::List(v) => v.extend(items),
        // A list subclass or set built by a call: its items are not needed.
        Unpickled::Object { .. } => {}
        _ => bail!("APPEND to something that is not a list"),
    }
    Ok(())
}

fn insert(dict: &mut Unpickled, items: Vec<(Unpickled, Unpickled)>) -> Result<()> {
    match dict {
        Unpickled::Dict(v) => {
            for (key, value) in items {
                match v.iter_mut().find(|(k, _)| *k == key) {
                    Some(slot) => slot.1 = value,
                    None => v.push((key, value)),
                }
            }
        }
        // `collections.OrderedDict()` is a call: it becomes the dict it builds.
        Unpickled::Object { class, .. } if class == "collections.OrderedDict" => {
            *dict = Unpickled::Dict(Vec::new());
            return insert(dict, items);
        }
        Unpickled::Object { .. } => {}
        _ => bail!("SETITEM on something that is not a dict"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps(argparse.Namespace(a=1, b='x', c=[1.5, None], d=True, e=-3, f=2**70,
    /// g={1: 'one'}, h=(1, 2)), protocol=2)`, as CPython 3.11 writes it.
    const NAMESPACE: &[u8] = b"\x80\x02cargparse\x0aNamespace\x0aq\x00)\x81q\x01}q\x02(X\x01\x00\x00\x00aq\x03K\x01X\x01\x00\x00\x00bq\x04X\x01\x00\x00\x00xq\x05X\x01\x00\x00\x00cq\x06]q\x07(G?\xf8\x00\x00\x00\x00\x00\x00NeX\x01\x00\x00\x00dq\x08\x88X\x01\x00\x00\x00eq\x09J\xfd\xff\xff\xffX\x01\x00\x00\x00fq\x0a\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@X\x01\x00\x00\x00gq\x0b}q\x0cK\x01X\x03\x00\x00\x00oneq\x0dsX\x01\x00\x00\x00hq\x0eK\x01K\x02\x86q\x0fub.";

    #[test]
    fn a_namespace_is_its_class_and_attributes() {
        let value = parse_pickle(NAMESPACE).unwrap();
        let Unpickled::Object { class, .. } = &value else {
            panic!("{value:?}")
        };
        assert_eq!(class, "argparse.Namespace");
        let attrs = value.attributes();
        assert_eq!(attrs.len(), 8);
        assert_eq!(attrs["a"], Unpickled::Int(1));
        assert_eq!(attrs["b"], Unpickled::Str("x".into()));
        assert_eq!(
            attrs["c"],
            Unpickled::List(vec![Unpickled::Float(1.5), Unpickled::None])
        );
        assert_eq!(attrs["d"], Unpickled::Bool(true));
        assert_eq!(attrs["e"], Unpickled::Int(-3));
        assert_eq!(attrs["f"], Unpickled::Float(2f64.powi(70)));
        assert_eq!(
            attrs["g"],
            Unpickled::Dict(vec![(Unpickled::Int(1), Unpickled::Str("one".into()))])
        );
        assert_eq!(
            attrs["h"],
            Unpickled::Tuple(vec![Unpickled::Int(1), Unpickled::Int(2)])
        );
    }

    #[test]
    fn wide_and_negative_longs() {
        assert_eq!(long(&[0xff]), Unpickled::Int(-1));
        assert_eq!(long(&[0x00, 0x01]), Unpickled::Int(256));
        assert_eq!(
            long(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]),
            Unpickled::Float(-(2f64.powi(64)) - 1.0)
        );
    }

    #[test]
    fn a_truncated_pickle_is_an_error_not_a_panic() {
        for end in 0..NAMESPACE.len() - 1 {
            assert!(parse_pickle(&NAMESPACE[..end]).is_err(), "{end}");
        }
    }
}
