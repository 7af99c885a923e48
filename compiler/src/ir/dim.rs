//! Symbolic dimensions: integer polynomials over dimension names (`B`, `H*D`, `S+1`, `2*N`).
//!
//! The representation is canonical (a sorted map from monomials to non-zero coefficients), so
//! two dimensions are equal exactly when their polynomials are equal: `H*D == D*H`,
//! `(S+1)-1 == S`. Division is not part of the algebra; write the product instead
//! (`E = H*Dh`).

use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// A product of dimension names, sorted (with repetition for powers).
pub type Monomial = Vec<String>;

/// A symbolic dimension.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Dim {
    terms: BTreeMap<Monomial, i64>,
}

impl Dim {
    /// A constant.
    pub fn constant(v: i64) -> Dim {
        let mut terms = BTreeMap::new();
        if v != 0 {
            terms.insert(Vec::new(), v);
        }
        Dim { terms }
    }

    /// A named dimension.
    pub fn sym(name: &str) -> Dim {
        let mut terms = BTreeMap::new();
        terms.insert(vec![name.to_string()], 1);
        Dim { terms }
    }

    /// The value if it contains no names.
    pub fn as_const(&self) -> Option<i64> {
        match self.terms.len() {
            0 => Some(0),
            1 => self.terms.get(&Vec::new()).copied(),
            _ => None,
        }
    }

    /// The single name if the dim is exactly one name.
    pub fn as_sym(&self) -> Option<&str> {
        let (mono, coef) = self.terms.iter().next()?;
        (self.terms.len() == 1 && *coef == 1 && mono.len() == 1).then(|| mono[0].as_str())
    }

    /// Every name it mentions, sorted, without repetition.
    pub fn symbols(&self) -> Vec<String> {
        let mut names: Vec<String> = self.terms.keys().flatten().cloned().collect();
        names.sort();
        names.dedup();
        names
    }

    /// The terms: monomial and coefficient.
    pub fn terms(&self) -> impl Iterator<Item = (&Monomial, i64)> {
        self.terms.iter().map(|(m, c)| (m, *c))
    }

    /// `self + other`
    pub fn add(&self, other: &Dim) -> Dim {
        let mut terms = self.terms.clone();
        for (m, c) in &other.terms {
            *terms.entry(m.clone()).or_insert(0) += c;
        }
        terms.retain(|_, c| *c != 0);
        Dim { terms }
    }

    /// `self - other`
    pub fn sub(&self, other: &Dim) -> Dim {
        self.add(&other.scale(-1))
    }

    /// `k * self`
    pub fn scale(&self, k: i64) -> Dim {
        let mut terms: BTreeMap<Monomial, i64> = self.terms.iter().map(|(m, c)| (m.clone(), c * k)).collect();
        terms.retain(|_, c| *c != 0);
        Dim { terms }
    }

    /// `self * other`
    pub fn mul(&self, other: &Dim) -> Dim {
        let mut terms: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (ma, ca) in &self.terms {
            for (mb, cb) in &other.terms {
                let mut m = ma.clone();
                m.extend(mb.iter().cloned());
                m.sort();
                *terms.entry(m).or_insert(0) += ca * cb;
            }
        }
        terms.retain(|_, c| *c != 0);
        Dim { terms }
    }

    /// The product of a list of dims (1 for the empty list).
    pub fn product<'a>(dims: impl IntoIterator<Item = &'a Dim>) -> Dim {
        dims.into_iter().fold(Dim::constant(1), |acc, d| acc.mul(d))
    }

    /// Replaces names by dims (names not in the map stay).
    pub fn substitute(&self, map: &HashMap<String, Dim>) -> Dim {
        let mut out = Dim::constant(0);
        for (m, c) in &self.terms {
            let mut term = Dim::constant(*c);
            for name in m {
                term = term.mul(map.get(name).unwrap_or(&Dim::sym(name)));
            }
            out = out.add(&term);
        }
        out
    }

    /// The value under the given bindings, or the first unbound name.
    pub fn eval(&self, env: &HashMap<String, i64>) -> Result<i64, String> {
        let mut total: i64 = 0;
        for (m, c) in &self.terms {
            let mut v = *c;
            for name in m {
                let x = env.get(name).ok_or_else(|| name.clone())?;
                v = v.saturating_mul(*x);
            }
            total = total.saturating_add(v);
        }
        Ok(total)
    }

    /// If exactly one name is unbound and it appears linearly (`a*X + b` with `a`, `b` known),
    /// solves `self == value` for it. Returns `(name, solution)`, or an explanation when the
    /// equation has no integer solution.
    pub fn solve(&self, value: i64, env: &HashMap<String, i64>) -> Option<Result<(String, i64), String>> {
        let unknown: Vec<String> = self.symbols().into_iter().filter(|s| !env.contains_key(s)).collect();
        if unknown.len() != 1 {
            return None;
        }
        let x = &unknown[0];
        let overflow = || Some(Err(format!("{self} = {value} overflows while solving for {x}")));
        let (mut a, mut b) = (0i64, 0i64);
        for (m, c) in &self.terms {
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
        if divisor.terms.len() != 1 {
            return None;
        }
        let (dm, dc) = divisor.terms.iter().next()?;
        let mut terms = BTreeMap::new();
        for (m, c) in &self.terms {
            if c % dc != 0 {
                return None;
            }
            let mut rest = m.clone();
            for name in dm {
                let pos = rest.iter().position(|n| n == name)?;
                rest.remove(pos);
            }
            terms.insert(rest, c / dc);
        }
        Some(Dim { terms })
    }

    /// Parses the canonical text (`B`, `H*D`, `2*S+1`, `S-1`); the IR text reader uses it.
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
        let constant = self.terms.get(&Vec::new()).copied();
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
            f.write_str(&m.join("*"))?;
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
        for text in ["H*D", "S+1", "2*S-1", "0", "-3", "B*S*E", "N-S+2"] {
            let d = Dim::parse(text).unwrap();
            assert_eq!(Dim::parse(&d.to_string()), Some(d.clone()), "{text}");
        }
        assert_eq!(Dim::parse("H*D").unwrap().to_string(), "D*H");
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
