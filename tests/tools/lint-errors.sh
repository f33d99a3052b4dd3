#!/bin/bash
# make lint (and make check): the error convention of /work/shared/STYLE.md ("Errors and ownership"),
# the parts of it a script can check, over server/, common/ and client/ (server/README.md, "Error
# convention").  Each finding is printed as file:line: rule: what, and any finding fails the run.
#   banned      no sprintf, vsprintf, strcpy, stpcpy, strcat, strncat, strtok, atoi, atol, atoll, atof,
#               gets, tmpnam, mktemp: snprintf, bounded copies, strtok_r, strtoull with full checks
#   exit        no exit, _exit, _Exit, quick_exit, abort or raise outside a main() file (server/main.c,
#               client/diloco.c) and the documented places below: a failure is returned to the caller,
#               and a daemon that cannot go on stops through daemon__fatal (not a raise(SIGTERM) to itself)
#   asprintf    every asprintf/vasprintf result is checked, as alloc below (the pointer is undefined
#               on failure, so it is the int that must be tested)
#   answered    no bare `return -1` in server/api/upload*.c: a handler that answered the request returns
#               API_ANSWERED (api.h), anything else a negative DL_E_* code
#   state-path  no path under the state directory (cache/, outer_metadata.json, redo.json, outer_state-,
#               checksum.key) is built by hand outside server/core/store.c: store.h's helpers make them
#   alloc       every malloc, calloc, realloc, reallocarray, aligned_alloc, strdup, strndup result is
#               checked: in a condition, compared in its expression, returned, or assigned and tested
#               within the next LOOKAHEAD statements, none of which may use it, decide anything or open
#               a block first (the end of its block is crossed, its else branches passed over)
# A call that a rule must not apply to says why on its line or the line above, greppably:
#       /* lint-errors: allow <rule>: <why> */
# (`grep -rn 'lint-errors: allow' server common client` lists them).  tests/tools/lint-errors.allow
# is a temporary list of known findings in files being rewritten (file:text of the line, one a line):
# they are reported as allowed, not failed, and an entry that matches nothing fails (it is stale).
# The analysis is textual (comments and strings blanked, statements split at ; { } outside
# parentheses): it can be fooled, never by accident in this code's style.
set -u
cd "$(dirname "$0")/../.."

ALLOW=${ALLOW:-tests/tools/lint-errors.allow}

# The documented places where a process ends at once (rule exit): file and the text of the call.
#   daemon.c's signal handler: a second SIGINT/SIGTERM during a shutdown exits at once (_exit: no
#   atexit handlers from a signal callback), as the operator asked twice.
documented_exit() {
    case "$1" in
    server/daemon.c) [[ "$2" == *"_exit(1)"* ]] ;;
    *) return 1 ;;
    esac
}

main_file() {
    case "$1" in
    server/main.c | client/diloco.c) return 0 ;;
    *) return 1 ;;
    esac
}

# One file: the findings, as file:line:rule:message, on stdout.
lint_file() {
    awk -v FILE="$1" -v LOOKAHEAD=12 -v SQ="'" '
    # ---- pass 1: blank comments, strings and character literals; note the exemptions per line ----
    function strip(line,    out, i, c, n, q) {
        out = ""
        n = length(line)
        for (i = 1; i <= n; i++) {
            c = substr(line, i, 1)
            if (incomment) {
                if (c == "*" && substr(line, i + 1, 1) == "/") { incomment = 0; i++; out = out "  " }
                else out = out " "
                continue
            }
            if (c == "/" && substr(line, i + 1, 1) == "*") { incomment = 1; i++; out = out "  "; continue }
            if (c == "/" && substr(line, i + 1, 1) == "/") break
            if (c == "\"" || c == SQ) {
                q = c
                out = out c
                for (i++; i <= n; i++) {
                    c = substr(line, i, 1)
                    if (c == "\\") { i++; out = out "  "; continue }
                    if (c == q) break
                    out = out " "
                }
                out = out q
                continue
            }
            out = out c
        }
        return out
    }
    {
        raw[NR] = $0
        if ($0 ~ /lint-errors: allow/) { allow_line[NR] = $0; allow_line[NR + 1] = $0 }
        s = strip($0)
        if (inpp || s ~ /^[ \t]*#/) {
            inpp = s ~ /\\[ \t]*$/
            pp[NR] = 1
        }
        text[NR] = s
    }
    function report(line, rule, msg) {
        if ((line in allow_line) && index(allow_line[line], "lint-errors: allow " rule) > 0) return
        printf "%s:%d:%s:%s\n", FILE, line, rule, msg
    }
    # ---- pass 2: statements (split at ; { } outside parentheses), each with its first line ----
    function split_statements(    l, i, c, n, depth, cur, start) {
        ns = 0; cur = ""; depth = 0; start = 1
        for (l = 1; l <= NR; l++) {
            if (l in pp) continue
            n = length(text[l])
            for (i = 1; i <= n; i++) {
                c = substr(text[l], i, 1)
                if (cur ~ /^[ \t\n]*$/) { cur = ""; start = l }
                # the braces of an initializer or a compound literal hold expressions, not statements
                if (c == "(" || c == "[" || (c == "{" && (depth > 0 || cur ~ /(=|return|,)[ \t\n]*$/ ||
                                 cur ~ /(=|return|,)[ \t\n]*\([A-Za-z_][A-Za-z0-9_ ]*\**\)[ \t\n]*$/))) {
                    depth++
                    cur = cur c
                    continue
                }
                if ((c == ")" || c == "]" || c == "}") && depth > 0) {
                    depth--
                    cur = cur c
                    continue
                }
                if (depth == 0 && (c == ";" || c == "{" || c == "}")) {
                    if (c == ";") cur = cur c
                    ns++; st[ns] = cur; st_line[ns] = start; st_end[ns] = c
                    cur = ""
                    continue
                }
                cur = cur c
            }
            cur = cur "\n"
        }
    }
    function trim_labels(s) {       # and a leading else: what the statement does
        sub(/^[ \t\n]+/, "", s)
        while (match(s, /^(case[^:]*|default|[A-Za-z_][A-Za-z0-9_]*)[ \t]*:[^:]/) || match(s, /^else[ \t\n]+/)) {
            s = substr(s, s ~ /^else/ ? RLENGTH + 1 : RLENGTH)
            sub(/^[ \t\n]+/, "", s)
        }
        return s
    }
    function line_at(k, pos,    before, n) {
        before = substr(st[k], 1, pos - 1)
        n = gsub(/\n/, "\n", before)
        return st_line[k] + n
    }
    # the position of the parenthesis that closes the one at pos (0 if none)
    function close_paren(s, pos,    i, d, c) {
        d = 0
        for (i = pos; i <= length(s); i++) {
            c = substr(s, i, 1)
            if (c == "(") d++
            else if (c == ")" && --d == 0) return i
        }
        return 0
    }
    # 1 when the text at pos of statement s is inside its if/while/for condition, or returned; a
    # braceless body (if (c) x = f();) is a statement of its own: body_at is where it starts (else 0)
    function in_condition(s, pos,    t, off, open, shut) {
        body_at = 0
        t = trim_labels(s)
        off = length(s) - length(t)
        if (t ~ /^return([^A-Za-z0-9_]|$)/) return 1
        if (!match(t, /^(if|while|for|switch)[ \t\n]*\(/)) return 0
        open = off + RLENGTH
        shut = close_paren(s, open)
        if (pos > open && pos < shut) return 1
        if (pos > shut) body_at = shut + 1
        return 0
    }
    # the lvalue that the call at pos is assigned to ("" if none)
    # (in_init: the call is a member of a braced initializer, and the lvalue the aggregate)
    function assigned_to(s, pos,    pre, i, c, p, n, lhs, depth) {
        pre = substr(s, 1, pos - 1)
        depth = 0
        in_init = 0
        for (i = length(pre); i > 1; i--) {
            c = substr(pre, i, 1)
            if (c == ")" || c == "]") depth++
            else if (c == "(" || c == "[") depth--
            if (depth > 0) continue             # inside a call or an index before ours: a ternary arm
            if (c == "{" && depth == 0 && substr(pre, 1, i - 1) ~ /=[ \t\n]*$/) {
                in_init = 1                     # T v = {f(), ...}: v.member is tested
                depth = 0
                continue
            }
            if (c == ";" || c == "{" || c == "}" || (c == "," && depth == 0 && !in_init)) return ""
            if (c != "=") continue
            p = substr(pre, i - 1, 1)
            n = substr(pre, i + 1, 1)
            if (n == "=" || p == "=" || p == "!" || p == "<" || p == ">") { i--; continue }
            if (p ~ /[-+*\/%&|^]/) return ""        # a compound assignment is no test
            lhs = substr(pre, 1, i - 1)
            sub(/[ \t\n]+$/, "", lhs)
            if (!match(lhs, /[A-Za-z_][A-Za-z0-9_]*((->|\.)[A-Za-z_][A-Za-z0-9_]*|\[[^]]*\])*$/)) return ""
            return substr(lhs, RSTART, RLENGTH)
        }
        return ""
    }
    function rx_quote(s,    out, i, c) {
        out = ""
        for (i = 1; i <= length(s); i++) {
            c = substr(s, i, 1)
            if (c ~ /[][\\.^$*+?(){}|\/-]/) out = out "\\" c
            else out = out c
        }
        return out
    }
    # does statement t use v (not as a member chain v->x, v.x, v[i] of it)?  mode "test": is it a test of v
    function uses(t, v, mode,    rx, rest, pre, post, ctrl) {
        rx = rx_quote(v)
        t = trim_labels(t)
        ctrl = t ~ /^((else[ \t\n]+)?(if|while)[ \t\n]*\(|return([^A-Za-z0-9_]|$))/
        rest = t
        while (match(rest, rx)) {
            pre = substr(rest, 1, RSTART - 1)
            post = substr(rest, RSTART + RLENGTH)
            rest = post
            if (pre ~ /[A-Za-z0-9_.>]$/ || post ~ /^[A-Za-z0-9_]/) continue
            if (post ~ /^[ \t\n]*(->|\.|\[)/) {
                if (mode != "test") return 1
                if (!in_init) continue
                sub(/^([ \t\n]*(->|\.)[ \t\n]*[A-Za-z_][A-Za-z0-9_]*)+/, "", post)     # the member tested
            }
            if (mode != "test") return 1
            if (ctrl) return 1
            if (post ~ /^[ \t\n]*(==|!=|<|>|\?)/ || pre ~ /(!|NULL[ \t\n]*(==|!=))[ \t\n(]*$/) return 1
        }
        return 0
    }
    # the call at pos of statement k, of the rule: checked?  Assigned, it must be tested by one of
    # the next LOOKAHEAD statements, none of them using it, deciding anything or opening a block first;
    # the end of its block is crossed, and the else branches of its chain are passed over.
    function checked(k, pos, rule, call,    s, v, j, after, t, looked, d) {
        s = st[k]
        while (!in_condition(s, pos)) {
            if (body_at == 0) break
            s = substr(s, body_at)
            pos -= body_at - 1
        }
        if (in_condition(s, pos)) return 1
        # compared in its expression: asprintf(...) < 0, (p = strdup(s)) == NULL
        after = substr(s, close_paren(s, pos + length(call)) + 1)
        if (after ~ /^[ \t\n)]*(<|>|==|!=)/) return 1
        v = assigned_to(s, pos)
        if (v == "") return 0
        if (st_end[k] != ";") return 0
        looked = 0
        for (j = k + 1; j <= ns && looked < LOOKAHEAD; j++) {
            t = st[j]
            if (t ~ /^[ \t\n]*$/ && st_end[j] == "}") continue        # the end of its block: on after it
            if (t ~ /^[ \t\n]*else([^A-Za-z0-9_]|$)/) {              # another branch: passed over whole
                for (d = st_end[j] == "{"; d > 0 && j < ns; ) {
                    j++
                    if (st_end[j] == "{") d++
                    else if (st_end[j] == "}") d--
                }
                continue
            }
            looked++
            if (uses(t, v, "test")) return 1
            if (uses(t, v, "any") || st_end[j] != ";") return 0
            if (trim_labels(t) ~ /^(if|while|for|switch|return|goto|break|continue)([^A-Za-z0-9_]|$)/) return 0
        }
        return 0
    }
    function scan_calls(k, rx, rule, what,    s, off, pos, name) {
        s = st[k]
        off = 0
        while (match(substr(s, off + 1), rx)) {
            pos = off + RSTART
            name = substr(s, pos, RLENGTH)
            off = pos + RLENGTH - 1
            if (pos > 1 && substr(s, pos - 1, 1) ~ /[A-Za-z0-9_.>]/) continue     # another name, a member
            sub(/[ \t\n]*\($/, "", name)
            if (!checked(k, pos, rule, name))
                report(line_at(k, pos), rule, name "() " what)
        }
    }
    END {
        # line rules (preprocessor lines included)
        for (l = 1; l <= NR; l++) {
            s = " " text[l]
            while (match(s, /[^A-Za-z0-9_.>](sprintf|vsprintf|strcpy|stpcpy|strcat|strncat|strtok|atoi|atol|atoll|atof|gets|tmpnam|mktemp)[ \t]*\(/)) {
                name = substr(s, RSTART + 1, RLENGTH - 1)
                sub(/[ \t]*\($/, "", name)
                report(l, "banned", name "() is banned (STYLE.md): snprintf, bounded copies, strtok_r, strtoull")
                s = substr(s, RSTART + RLENGTH)
            }
            if (FILE != "server/core/store.c" && text[l] ~ /(v?asprintf|snprintf|sb_str|sb_add|path_fmt)[ \t]*\(/ &&
                raw[l] ~ /"[^"]*(cache\/incoming|cache\/deltas|outer_metadata\.json|redo\.json|outer_state-|checksum\.key)/)
                report(l, "state-path", "a path under the state directory built by hand: store.h makes it (store_path_*)")
            if (FILE ~ /^server\/api\/upload/ && text[l] ~ /return[ \t]+-1[ \t]*;/)
                report(l, "answered", "a bare return -1 in an upload handler: API_ANSWERED once answered (api.h), else a negative DL_E_* code")
            s = " " text[l]
            if (match(s, /[^A-Za-z0-9_.>](exit|_exit|_Exit|quick_exit|abort|raise)[ \t]*\(/)) {
                name = substr(s, RSTART + 1, RLENGTH - 1)
                sub(/[ \t]*\($/, "", name)
                print FILE ":" l ":exit-candidate:" name ":" raw[l]
            }
        }
        split_statements()
        for (k = 1; k <= ns; k++) {
            scan_calls(k, "v?asprintf[ \t\n]*\\(", "asprintf", "result not checked (the pointer is undefined on failure)")
            scan_calls(k, "(malloc|calloc|realloc|reallocarray|aligned_alloc|strdup|strndup)[ \t\n]*\\(", "alloc",
                       "result not checked for NULL")
        }
    }' "$1"
}

# --self-test: the fixture's findings must be exactly its lines marked BAD (the rules still bite).
FIXTURE=tests/tools/lint-errors-fixture.c
if [ "${1:-}" = --self-test ]; then
    want=$(grep -n '/[*] BAD ' "$FIXTURE" | cut -d: -f1 | sort -n | tr '\n' ' ')
    got=$(ALLOW=/dev/null bash "$0" "$FIXTURE" 2>&1 | grep "^$FIXTURE:" | cut -d: -f2 | sort -n | tr '\n' ' ')
    if [ "$want" != "$got" ]; then
        echo "lint-errors: self-test FAILED: $FIXTURE's findings at lines [$got], its BAD lines [$want]" >&2
        exit 1
    fi
    echo "lint-errors: self-test: the fixture's $(wc -w <<<"$want") violations found, nothing else"
    exit 0
fi

# --write-allow: the allow list rewritten to today's findings (its comments kept), for the merge of a
# branch that moved the lines it names; review its diff: it must only shrink, or name lines moved.
if [ "${1:-}" = --write-allow ]; then
    entries=$(ALLOW=/dev/null bash "$0" 2>&1 | grep -E '^[a-z]+/[^:]+:[0-9]+: ' | while IFS=: read -r f n _; do
        printf '%s:%s\n' "$f" "$(sed -n "${n}p" "$f" | sed 's/^[[:space:]]*//')"
    done | awk '!seen[$0]++')
    { grep '^#' "$ALLOW"; [ -n "$entries" ] && echo "$entries"; } >"$ALLOW.new" && mv "$ALLOW.new" "$ALLOW"
    echo "lint-errors: $ALLOW: $(grep -vc '^#' "$ALLOW") entries"
    exit 0
fi

# The tree, or the files named.
if [ $# -gt 0 ]; then
    files="$*"
else
    files=$(ls server/*.[ch] server/*/*.[ch] common/*.[ch] client/*.[ch] 2>/dev/null)
fi
findings=""
for f in $files; do
    if ! out=$(lint_file "$f"); then
        echo "lint-errors: cannot check $f (the script's awk failed)" >&2
        exit 2
    fi
    findings+="$out"$'\n'
done

# The exit rule needs the file and the call's text: a main() file or a documented place passes.
bad=0
allowed=0
declare -A used_allow=() allowed_in=()
allow_entries=()
if [ -f "$ALLOW" ]; then
    while IFS= read -r entry; do
        [[ -z "$entry" || "$entry" == \#* ]] && continue
        allow_entries+=("$entry")
    done <"$ALLOW"
fi

is_allowed() {      # file, line number: 0 if an allow entry names this file and a text of this line
    local f=$1 n=$2 src e
    src=$(sed -n "${n}p" "$f")
    for e in "${allow_entries[@]}"; do
        if [[ "${e%%:*}" == "$f" && "$src" == *"${e#*:}"* ]]; then
            used_allow[$e]=1
            return 0
        fi
    done
    return 1
}

while IFS= read -r row; do
    [ -z "$row" ] && continue
    f=${row%%:*}; rest=${row#*:}
    n=${rest%%:*}; rest=${rest#*:}
    rule=${rest%%:*}; msg=${rest#*:}
    if [ "$rule" = exit-candidate ]; then
        name=${msg%%:*}; src=${msg#*:}
        if main_file "$f" || documented_exit "$f" "$src"; then
            continue
        fi
        if [[ "$src" == *"lint-errors: allow exit"* ]] ||
            sed -n "$((n - 1))p" "$f" | grep -q 'lint-errors: allow exit'; then
            continue
        fi
        rule=exit
        msg="$name() outside main(): return the failure (0 or a negative errno) to the caller"
        [ "$name" = raise ] && msg="raise() outside main(): a fatal error in the daemon is daemon__fatal(), anything else is returned"
    fi
    if is_allowed "$f" "$n"; then
        allowed=$((allowed + 1))
        allowed_in[$f]=$((${allowed_in[$f]:-0} + 1))
        continue
    fi
    echo "$f:$n: $rule: $msg" >&2
    bad=$((bad + 1))
done <<<"$findings"

for e in "${allow_entries[@]}"; do
    if [ -z "${used_allow[$e]:-}" ]; then
        echo "$ALLOW: \"$e\" matches no finding: remove it" >&2
        bad=$((bad + 1))
    fi
done

nfiles=$(wc -w <<<"$files")
for f in "${!allowed_in[@]}"; do
    echo "lint-errors: $f: ${allowed_in[$f]} known finding(s) allowed for now by $ALLOW"
done | sort
if [ "$bad" != 0 ]; then
    echo "lint-errors: FAILED, $bad finding(s) in $nfiles files (see server/README.md, Error convention)" >&2
    exit 1
fi
known=""
[ "$allowed" != 0 ] && known=" ($allowed allowed for now by $ALLOW)"
echo "lint-errors: $nfiles files checked: no banned call, no exit outside main, every asprintf and allocation checked," \
    "no state path by hand$known"
