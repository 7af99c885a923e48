//! Symbolic dimensions: integer polynomials over dimension names (`B`, `H*D`, `S+1`, `2*N`).
//!
//! The representation is canonical (a sorted map from monomials to non-zero coefficients), so
//! two dimensions are equal exactly when their polynomials are equal: `H*D == D*H`,
//! `(S+1)-1 == S`. Division is not part of the algebra; write the product instead
//! (`E = H*Dh`).
//!
//! Arithmetic is checked: a coefficient that would leave `i64` makes the result the
//! *overflow* dim ([`Dim::is_overflow`]), which every later operation keeps and every evaluation
//! refuses; the lowering reports it where the program wrote it (E0116).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

/// A product of dimension names, sorted (with repetition for powers).
pub type Monomial = Vec<String>;

/// A symbolic dimension.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Dim {
    /// Terms sorted by monomial, no zero coefficients: the order, equality and hash of the
    /// sorted map it stands for. A shared slice, not a `BTreeMap`: a map's first node holds
    /// room for eleven terms (hundreds of bytes), and a program has several dims per value;
    /// shared, a dim is copied by a reference count (types are copied into every node).
    terms: Arc<[(Monomial, i64)]>,
}

/// The name that marks the overflow dim (no program can write it).
const OVERFLOW: &str = "<overflow>";

/// Why a dim has no value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DimError {
    /// A name the bindings lack.
    #[error("dimension `{0}` is not bound")]
    Unbound(String),
    /// The value (or an intermediate term) does not fit in `i64`.
    #[error("dimension {0} overflows a 64-bit integer")]
    Overflow(String),
}

impl Dim {
    /// A constant.
    pub fn constant(v: i64) -> Dim {
        Dim { terms: if v != 0 { Arc::from([(Vec::new(), v)]) } else { Arc::from([]) } }
    }

    /// A named dimension.
    pub fn sym(name: &str) -> Dim {
        Dim { terms: Arc::from([(vec![name.to_string()], 1)]) }
    }

    /// The dim of a sorted map of terms (zero coefficients dropped).
    fn from_map(map: BTreeMap<Monomial, i64>) -> Dim {
        Dim { terms: map.into_iter().filter(|(_, c)| *c != 0).collect() }
    }

    /// The coefficient of a monomial.
    fn coefficient(&self, m: &[String]) -> Option<i64> {
        self.terms.binary_search_by(|(k, _)| k.as_slice().cmp(m)).ok().map(|i| self.terms[i].1)
    }

    /// The value if it contains no names.
    pub fn as_const(&self) -> Option<i64> {
        match self.terms.len() {
            0 => Some(0),
            1 => self.coefficient(&[]),
            _ => None,
        }
    }

    /// The single name if the dim is exactly one name.
    pub fn as_sym(&self) -> Option<&str> {
        let (mono, coef) = self.terms.first()?;
        (self.terms.len() == 1 && *coef == 1 && mono.len() == 1).then(|| mono[0].as_str())
    }

    /// Every name it mentions, sorted, without repetition.
    pub fn symbols(&self) -> Vec<String> {
        let mut names: Vec<String> = self.terms.iter().flat_map(|(m, _)| m).cloned().collect();
        names.sort();
        names.dedup();
        names
    }

    /// The terms: monomial and coefficient.
    pub fn terms(&self) -> impl Iterator<Item = (&Monomial, i64)> {
        self.terms.iter().map(|(m, c)| (m, *c))
    }

    /// The result of arithmetic that left `i64`.
    pub fn overflow() -> Dim {
        Dim::sym(OVERFLOW)
    }

    /// Whether arithmetic that made this dim overflowed.
    pub fn is_overflow(&self) -> bool {
        self.terms.iter().any(|(m, _)| m.iter().any(|n| n == OVERFLOW))
    }

    /// A dim from terms, or the overflow dim when a coefficient overflowed (`None`).
    fn from_terms(terms: impl IntoIterator<Item = (Monomial, Option<i64>)>) -> Dim {
        let mut out = BTreeMap::new();
        for (m, c) in terms {
            let Some(c) = c else { return Dim::overflow() };
            if c != 0 {
                out.insert(m, c);
            }
        }
        Dim::from_map(out)
    }

    /// `self + other`
    pub fn add(&self, other: &Dim) -> Dim {
        if self.is_overflow() || other.is_overflow() {
            return Dim::overflow();
        }
        let mut terms: BTreeMap<Monomial, Option<i64>> = self.terms.iter().map(|(m, c)| (m.clone(), Some(*c))).collect();
        for (m, c) in other.terms.iter() {
            let t = terms.entry(m.clone()).or_insert(Some(0));
            *t = t.and_then(|t| t.checked_add(*c));
        }
        Dim::from_terms(terms)
    }

    /// `self - other`
    pub fn sub(&self, other: &Dim) -> Dim {
        self.add(&other.scale(-1))
    }

    /// `k * self`
    pub fn scale(&self, k: i64) -> Dim {
        if self.is_overflow() {
            return Dim::overflow();
        }
        Dim::from_terms(self.terms.iter().map(|(m, c)| (m.clone(), c.checked_mul(k))))
    }

    /// `self * other`
    pub fn mul(&self, other: &Dim) -> Dim {
        if self.is_overflow() || other.is_overflow() {
            return Dim::overflow();
        }
        let mut terms: BTreeMap<Monomial, Option<i64>> = BTreeMap::new();
        for (ma, ca) in self.terms.iter() {
            for (mb, cb) in other.terms.iter() {
                let mut m = ma.clone();
                m.extend(mb.iter().cloned());
                m.sort();
                let t = terms.entry(m).or_insert(Some(0));
                *t = t.and_then(|t| t.checked_add(ca.checked_mul(*cb)?));
            }
        }
        Dim::from_terms(terms)
    }

    /// The product of a list of dims (1 for the empty list).
    pub fn product<'a>(dims: impl IntoIterator<Item = &'a Dim>) -> Dim {
        dims.into_iter().fold(Dim::constant(1), |acc, d| acc.mul(d))
    }

    /// Replaces names by dims (names not in the map stay).
    pub fn substitute(&self, map: &HashMap<String, Dim>) -> Dim {
        let mut out = Dim::constant(0);
        for (m, c) in self.terms.iter() {
            let mut term = Dim::constant(*c);
            for name in m {
                term = term.mul(map.get(name).unwrap_or(&Dim::sym(name)));
            }
            out = out.add(&term);
        }
        out
    }

    /// The value under the given bindings, with checked arithmetic.
    pub fn eval(&self, env: &HashMap<String, i64>) -> Result<i64, DimError> {
        let overflow = || DimError::Overflow(self.to_string());
        if self.is_overflow() {
            return Err(overflow());
        }
        let mut total: i64 = 0;
        for (m, c) in self.terms.iter() {
            let mut v = *c;
            for name in m {
                let x = env.get(name).ok_or_else(|| DimError::Unbound(name.clone()))?;
                v = v.checked_mul(*x).ok_or_else(overflow)?;
            }
            total = total.checked_add(v).ok_or_else(overflow)?;
        }
        Ok(total)
    }

    /// If exactly one name is unbound and it appears linearly (`a*X + b` with `a`, `b` known),
    /// solves `self == value` for it. Returns `(name, solution)`, or an explanation when the
    /// equation has no integer solution.
    pub fn solve(&self, value: i64, env: &HashMap<String, i64>) -> Option<Result<(String, i64), String>> {
        if self.is_overflow() {
            return Some(Err(format!("a dimension expression overflows a 64-bit integer (solving for {value})")));
        }
        let unknown: Vec<String> = self.symbols().into_iter().filter(|s| !env.contains_key(s)).collect();
        if unknown.len() != 1 {
            return None;
        }
        let x = &unknown[0];
        let overflow = || Some(Err(format!("{self} = {value} overflows while solving for {x}")));
        let (mut a, mut b) = (0i64, 0i64);
        for (m, c) in self.terms.iter() {
            let count = m.iter().filter(|n| *n == x).count();
            let mut known = *c;
            for n in m.iter().filter(|n| *n != x) {
                let Some(k) = env.get(n).and_then(|v| known.checked_mul(*v)) else { return overflow() };
                known = k;
            }
            let slot = match count {
                0 => &mut b,
                1 => &mut a,
                _ => return None,
            };
            let Some(sum) = slot.checked_add(known) else { return overflow() };
            *slot = sum;
        }
        if a == 0 {
            return None;
        }
        let Some(rest) = value.checked_sub(b) else { return overflow() };
        if rest % a != 0 || rest / a < 0 {
            return Some(Err(format!("{self} = {value} has no non-negative integer solution for {x}")));
        }
        Some(Ok((x.clone(), rest / a)))
    }

    /// `self / divisor` when the divisor is a single term (`H`, `8`, `2*H`) that divides every
    /// term of `self` exactly; `None` otherwise. (`(H*D)/H = D`, `(8*D)/8 = D`, `E/H = None`.)
    pub fn div_exact(&self, divisor: &Dim) -> Option<Dim> {
        if divisor.terms.len() != 1 || self.is_overflow() || divisor.is_overflow() {
            return None;
        }
        let (dm, dc) = divisor.terms.first()?;
        let mut terms = BTreeMap::new();
        for (m, c) in self.terms.iter() {
            if c.checked_rem(*dc)? != 0 {
                return None;
            }
            let mut rest = m.clone();
            for name in dm {
                let pos = rest.iter().position(|n| n == name)?;
                rest.remove(pos);
            }
            terms.insert(rest, c.checked_div(*dc)?);
        }
        Some(Dim::from_map(terms))
    }

    /// The name of the quotient `name / divisor` that a signature's `D/2` introduces: `D/2`
    /// (printed in parentheses inside a product: `2*(D/2)`). The signature's `D` is then
    /// `divisor · (D/2)`, a polynomial like any other.
    pub fn quotient_name(name: &str, divisor: i64) -> String {
        format!("{name}/{divisor}")
    }

    /// The name and divisor of a quotient name (`D/2` gives `("D", 2)`).
    pub fn quotient_parts(name: &str) -> Option<(&str, i64)> {
        let (n, d) = name.split_once('/')?;
        let d: i64 = d.parse().ok().filter(|d| *d > 0)?;
        (!n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some((n, d))
    }

    /// Parses the canonical text (`B`, `H*D`, `2*S+1`, `S-1`, `2*(D/2)`); the IR text reader
    /// uses it.
    pub fn parse(text: &str) -> Option<Dim> {
        let text: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        if text.is_empty() {
            return None;
        }
        let mut out = Dim::constant(0);
        let mut rest = text.as_str();
        let mut sign = 1;
        if let Some(r) = rest.strip_prefix('-') {
            sign = -1;
            rest = r;
        }
        loop {
            let end = rest.find(['+', '-']).unwrap_or(rest.len());
            let term = &rest[..end];
            let mut t = Dim::constant(sign);
            for factor in term.split('*') {
                let f = if let Ok(v) = factor.parse::<i64>() {
                    Dim::constant(v)
                } else if !factor.is_empty()
                    && factor.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !factor.starts_with(|c: char| c.is_ascii_digit())
                {
                    Dim::sym(factor)
                } else if let Some(q) =
                    factor.strip_prefix('(').and_then(|f| f.strip_suffix(')')).filter(|q| Dim::quotient_parts(q).is_some())
                {
                    Dim::sym(q)
                } else {
                    return None;
                };
                t = t.mul(&f);
            }
            out = out.add(&t);
            if end == rest.len() {
                return Some(out);
            }
            sign = if rest.as_bytes()[end] == b'-' { -1 } else { 1 };
            rest = &rest[end + 1..];
        }
    }
}

impl From<i64> for Dim {
    fn from(v: i64) -> Dim {
        Dim::constant(v)
    }
}

impl fmt::Display for Dim {
    /// Non-constant terms in canonical order, then the constant: `H*D`, `S+1`, `2*S-1`, `0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.terms.is_empty() {
            return f.write_str("0");
        }
        if self.is_overflow() {
            return f.write_str(OVERFLOW);
        }
        let constant = self.coefficient(&[]);
        let mut first = true;
        for (m, c) in self.terms.iter().filter(|(m, _)| !m.is_empty()) {
            let mag = c.unsigned_abs();
            if *c < 0 {
                f.write_str("-")?;
            } else if !first {
                f.write_str("+")?;
            }
            if mag != 1 {
                write!(f, "{mag}*")?;
            }
            let names: Vec<String> = m.iter().map(|n| if n.contains('/') { format!("({n})") } else { n.clone() }).collect();
            f.write_str(&names.join("*"))?;
            first = false;
        }
        if let Some(c) = constant {
            if first {
                write!(f, "{c}")?;
            } else if c < 0 {
                write!(f, "-{}", c.unsigned_abs())?;
            } else {
                write!(f, "+{c}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_and_round_trip() {
        let hd = Dim::sym("H").mul(&Dim::sym("D"));
        assert_eq!(hd, Dim::sym("D").mul(&Dim::sym("H")));
        assert_eq!(Dim::sym("S").add(&Dim::constant(1)).sub(&Dim::constant(1)), Dim::sym("S"));
        for text in ["H*D", "S+1", "2*S-1", "0", "-3", "B*S*E", "N-S+2", "2*(D/2)", "(D/4)*H+1"] {
            let d = Dim::parse(text).unwrap();
            assert_eq!(Dim::parse(&d.to_string()), Some(d.clone()), "{text}");
        }
        assert_eq!(Dim::parse("H*D").unwrap().to_string(), "D*H");
        // A quotient name prints in parentheses and is the only name with a `/`.
        let half = Dim::sym(&Dim::quotient_name("D", 2)).scale(2);
        assert_eq!(half.to_string(), "2*(D/2)");
        assert_eq!(Dim::quotient_parts("D/2"), Some(("D", 2)));
        for bad in ["D/0", "D/-2", "/2", "D/x", "2*D/2", "(D/2"] {
            assert!(Dim::quotient_parts(bad).is_none() || Dim::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn solve_linear() {
        let env: HashMap<String, i64> = [("H".to_string(), 8)].into();
        let hd = Dim::parse("H*D").unwrap();
        assert_eq!(hd.solve(512, &env), Some(Ok(("D".to_string(), 64))));
        assert!(matches!(hd.solve(500, &env), Some(Err(_))));
        assert_eq!(hd.div_exact(&Dim::sym("H")), Some(Dim::sym("D")));
        assert_eq!(Dim::parse("8*D").unwrap().div_exact(&Dim::constant(8)), Some(Dim::sym("D")));
        assert_eq!(Dim::sym("E").div_exact(&Dim::sym("H")), None);
        assert_eq!(Dim::parse("D*D").unwrap().solve(4, &HashMap::new()), None);
    }
}
