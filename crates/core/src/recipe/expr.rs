//! The expressions a recipe computes its numbers and conditions with: integers, booleans and the
//! configuration's values, `+ - * / %` (exact integer arithmetic: a division that leaves a
//! remainder is an error, since a recipe's sizes must divide), comparisons, `&& || !`, a
//! conditional `c ? a : b`, and the functions `roundup(a, b)` (the least multiple of `b` not below
//! `a`), `min` and `max`. A bare name evaluates to its value as the configuration holds it
//! (a float, a string), so that a recipe can copy `rope_theta` without arithmetic.

use serde_json::Value;

/// Evaluate `text` with the names `lookup` resolves; `Err` is a message for the caller to
/// prefix with where the expression came from.
pub fn eval(text: &str, lookup: &dyn Fn(&str) -> Option<Value>) -> Result<Value, String> {
    let tokens = lex(text)?;
    let mut p = Parser {
        tokens: &tokens,
        at: 0,
        lookup,
    };
    let v = p.ternary()?;
    if p.at != tokens.len() {
        return Err(format!("`{text}`: unexpected `{}`", tokens[p.at]));
    }
    Ok(v)
}

/// Evaluate `text` to a non-negative integer (a size, an index, a count).
pub fn eval_u64(text: &str, lookup: &dyn Fn(&str) -> Option<Value>) -> Result<u64, String> {
    let v = eval(text, lookup)?;
    as_int(&v)
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| format!("`{text}` is {v}, not a non-negative integer"))
}

/// Evaluate `text` to a truth value (a boolean, or an integer: nonzero is true).
pub fn eval_bool(text: &str, lookup: &dyn Fn(&str) -> Option<Value>) -> Result<bool, String> {
    let v = eval(text, lookup)?;
    truth(&v).ok_or_else(|| format!("`{text}` is {v}, not true or false"))
}

/// The integer a value holds: an integer, a float with no fraction, or a boolean (0 / 1).
fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| {
            let f = n.as_f64()?;
            (f.fract() == 0.0 && f.abs() < 9.0e15).then_some(f as i64)
        }),
        Value::Bool(b) => Some(*b as i64),
        _ => None,
    }
}

/// The truth of a value: booleans, integers (nonzero), `null` (false).
fn truth(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::Null => Some(false),
        _ => as_int(v).map(|i| i != 0),
    }
}

/// A token of an expression.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    /// An integer literal.
    Int(i64),
    /// A name (a parameter, a loop variable, a configuration key, a function).
    Name(String),
    /// An operator or punctuation.
    Op(&'static str),
}

impl std::fmt::Display for Tok {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tok::Int(i) => write!(f, "{i}"),
            Tok::Name(n) => write!(f, "{n}"),
            Tok::Op(o) => write!(f, "{o}"),
        }
    }
}

/// Operators, longest first so that `==` is not read as `=`.
const OPS: &[&str] = &[
    "==", "!=", "<=", ">=", "&&", "||", "+", "-", "*", "/", "%", "(", ")", ",", "<", ">", "!", "?",
    ":",
];

/// Split an expression into tokens (at most 256 of them: a recipe's expressions are short).
fn lex(text: &str) -> Result<Vec<Tok>, String> {
    let mut out = vec![];
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let n = text[start..i]
                .parse::<i64>()
                .map_err(|_| format!("`{text}`: number too large"))?;
            out.push(Tok::Int(n));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'.') {
                i += 1;
            }
            out.push(Tok::Name(text[start..i].to_string()));
        } else if let Some(op) = OPS.iter().find(|op| text[i..].starts_with(**op)) {
            out.push(Tok::Op(op));
            i += op.len();
        } else {
            return Err(format!("`{text}`: unexpected character `{}`", c as char));
        }
        if out.len() > 256 {
            return Err(format!(
                "`{}…`: expression too long",
                &text[..40.min(text.len())]
            ));
        }
    }
    Ok(out)
}

/// A recursive-descent parser that evaluates as it goes.
struct Parser<'a> {
    tokens: &'a [Tok],
    at: usize,
    lookup: &'a dyn Fn(&str) -> Option<Value>,
}

/// Binary operators by precedence level, loosest first.
const LEVELS: &[&[&str]] = &[
    &["||"],
    &["&&"],
    &["==", "!="],
    &["<", "<=", ">", ">="],
    &["+", "-"],
    &["*", "/", "%"],
];

impl Parser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.tokens.get(self.at)
    }

    fn eat(&mut self, op: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Op(o)) if *o == op) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.eat(op) {
            Ok(())
        } else {
            Err(match self.peek() {
                Some(t) => format!("expected `{op}`, found `{t}`"),
                None => format!("expected `{op}` at the end"),
            })
        }
    }

    fn ternary(&mut self) -> Result<Value, String> {
        let c = self.binary(0)?;
        if !self.eat("?") {
            return Ok(c);
        }
        let yes = self.ternary()?;
        self.expect(":")?;
        let no = self.ternary()?;
        let t = truth(&c).ok_or_else(|| format!("{c} is not true or false"))?;
        Ok(if t { yes } else { no })
    }

    fn binary(&mut self, level: usize) -> Result<Value, String> {
        if level == LEVELS.len() {
            return self.unary();
        }
        let mut left = self.binary(level + 1)?;
        loop {
            let Some(op) = LEVELS[level].iter().find(|op| self.eat(op)) else {
                return Ok(left);
            };
            let right = self.binary(level + 1)?;
            left = apply(op, &left, &right)?;
        }
    }

    fn unary(&mut self) -> Result<Value, String> {
        if self.eat("!") {
            let v = self.unary()?;
            let t = truth(&v).ok_or_else(|| format!("`!` of {v}, not true or false"))?;
            return Ok(Value::Bool(!t));
        }
        if self.eat("-") {
            let v = self.unary()?;
            let i = as_int(&v).ok_or_else(|| format!("`-` of {v}, not an integer"))?;
            return Ok(Value::from(-i));
        }
        self.atom()
    }

    fn atom(&mut self) -> Result<Value, String> {
        let Some(tok) = self.peek().cloned() else {
            return Err("expression ends too early".into());
        };
        self.at += 1;
        match tok {
            Tok::Int(i) => Ok(Value::from(i)),
            Tok::Op("(") => {
                let v = self.ternary()?;
                self.expect(")")?;
                Ok(v)
            }
            Tok::Name(n) if n == "true" || n == "false" => Ok(Value::Bool(n == "true")),
            Tok::Name(n) if n == "null" => Ok(Value::Null),
            Tok::Name(n) if self.eat("(") => {
                let mut args = vec![self.ternary()?];
                while self.eat(",") {
                    args.push(self.ternary()?);
                }
                self.expect(")")?;
                call(&n, &args)
            }
            Tok::Name(n) => (self.lookup)(&n).ok_or_else(|| format!("unknown name `{n}`")),
            Tok::Op(o) => Err(format!("unexpected `{o}`")),
        }
    }
}

/// The integers of a function's or operator's operands.
fn ints(what: &str, args: &[&Value]) -> Result<Vec<i64>, String> {
    args.iter()
        .map(|v| as_int(v).ok_or_else(|| format!("`{what}` of {v}, not an integer")))
        .collect()
}

/// A binary operator.
fn apply(op: &str, a: &Value, b: &Value) -> Result<Value, String> {
    match op {
        "==" => return Ok(Value::Bool(same(a, b))),
        "!=" => return Ok(Value::Bool(!same(a, b))),
        "&&" | "||" => {
            let (x, y) = (truth(a), truth(b));
            let (Some(x), Some(y)) = (x, y) else {
                return Err(format!("`{op}` of {a} and {b}, not true or false"));
            };
            return Ok(Value::Bool(if op == "&&" { x && y } else { x || y }));
        }
        _ => {}
    }
    let v = ints(op, &[a, b])?;
    let (x, y) = (v[0], v[1]);
    let overflow = || format!("{x} {op} {y} overflows");
    Ok(match op {
        "+" => Value::from(x.checked_add(y).ok_or_else(overflow)?),
        "-" => Value::from(x.checked_sub(y).ok_or_else(overflow)?),
        "*" => Value::from(x.checked_mul(y).ok_or_else(overflow)?),
        "/" | "%" if y == 0 => return Err(format!("{x} {op} 0")),
        "/" if x % y != 0 => return Err(format!("{x} / {y} is not a whole number")),
        "/" => Value::from(x / y),
        "%" => Value::from(x % y),
        "<" => Value::Bool(x < y),
        "<=" => Value::Bool(x <= y),
        ">" => Value::Bool(x > y),
        ">=" => Value::Bool(x >= y),
        _ => return Err(format!("unknown operator `{op}`")),
    })
}

/// Equality that takes `2` and `2.0` for the same number.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// A function call.
fn call(name: &str, args: &[Value]) -> Result<Value, String> {
    let refs: Vec<&Value> = args.iter().collect();
    let v = ints(name, &refs)?;
    match (name, v.as_slice()) {
        ("roundup", [a, b]) if *b > 0 => {
            let r = a.rem_euclid(*b);
            Ok(Value::from(if r == 0 { *a } else { a + (b - r) }))
        }
        ("roundup", [_, b]) => Err(format!("roundup to a multiple of {b}")),
        ("min", [_, ..]) => Ok(Value::from(*v.iter().min().expect("non-empty"))),
        ("max", [_, ..]) => Ok(Value::from(*v.iter().max().expect("non-empty"))),
        _ => Err(format!(
            "unknown function `{name}` of {} argument(s) (roundup(a, b), min, max)",
            args.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env(n: &str) -> Option<Value> {
        Some(match n {
            "heads" => json!(8),
            "groups" => json!(2),
            "theta" => json!(10000.0),
            "eps" => json!(1e-6),
            "gqa" => json!(true),
            "name" => json!("llama"),
            _ => return None,
        })
    }

    #[test]
    fn arithmetic_conditions_and_functions() {
        let u = |t: &str| eval_u64(t, &env);
        assert_eq!(u("heads / groups + 2"), Ok(6));
        assert_eq!(u("(heads / groups + 2) * 16"), Ok(96));
        assert_eq!(u("roundup(96, 128 * 2)"), Ok(256));
        assert_eq!(u("roundup(256, 128)"), Ok(256));
        assert_eq!(u("gqa ? groups : heads"), Ok(2));
        assert_eq!(u("!gqa ? groups : heads"), Ok(8));
        assert_eq!(u("max(1, heads % 3, min(4, 5))"), Ok(4));
        assert_eq!(eval("theta", &env), Ok(json!(10000.0)));
        assert_eq!(eval("name == name && 2 == 2", &env), Ok(json!(true)));
        assert_eq!(eval_bool("heads > groups || 0", &env), Ok(true));
        assert!(u("heads / 3").unwrap_err().contains("not a whole number"));
        assert!(u("heads - 9").unwrap_err().contains("not a non-negative"));
        assert!(u("nope + 1").unwrap_err().contains("unknown name `nope`"));
        assert!(u("heads +").unwrap_err().contains("ends too early"));
        assert!(u("heads 2").unwrap_err().contains("unexpected `2`"));
        assert_eq!(u("theta * 2"), Ok(20000));
        assert!(u("eps * 2").unwrap_err().contains("not an integer"));
        assert!(u("x$").unwrap_err().contains("unexpected character"));
        assert!(u("roundup(1)").unwrap_err().contains("unknown function"));
        assert!(u("9223372036854775807 + 1")
            .unwrap_err()
            .contains("overflows"));
    }
}
