// k8s-check reads multi-document YAML (the output of `helm template`, or manifests) and checks
// every object against the Kubernetes API types, the way the API server's strict field
// validation would:
//
//   - an object of a built-in kind (k8s.io/api at the version in go.mod) is decoded strictly into
//     its Go type by apiVersion and kind: a field the type does not have, a field spelled in the
//     wrong case, a field given twice, or a value of the wrong type (a string where an integer
//     goes, a list where a map goes) fails;
//   - an object of a kind from a CRD that k8s.io/api does not have (ServiceMonitor, PrometheusRule,
//     TrainJob, Instrumentation, listed in customKinds) is checked for shape only: apiVersion and
//     kind known, metadata decoded strictly into ObjectMeta with a name, no top-level field other
//     than apiVersion, kind, metadata and spec, and spec a map; the parts of spec whose type is a
//     Kubernetes one (customTypedParts: a TrainJob's trainer.env and resourcesPerNode, an
//     Instrumentation's env lists and resources, a ServiceMonitor's selector) are decoded strictly
//     into it. The rest of spec is not checked;
//   - any other kind fails (unknown kinds are not waved through);
//   - on every object: metadata.name a valid name, label keys and values and annotation keys
//     valid; on workloads (Deployment, StatefulSet, DaemonSet, Job, ReplicaSet) the selector
//     matches the pod template's labels; in every container, each $(VAR) in an env value names a
//     variable defined earlier in that container's env (Kubernetes leaves any other reference
//     as literal text, silently).
//
// It does not check: defaulting, the API server's value validation beyond the above (ports in
// range, resource quantities' units are checked by decoding only), admission, or anything
// inside a CRD's spec.
//
// Usage: k8s-check FILE...   ("-" reads standard input). Prints one line per object; exits 1
// when any object fails, 2 on a usage or read error.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/validation"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	kjsonutil "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// customKinds: kinds from CRDs that are checked for shape only (see the package comment).
var customKinds = map[schema.GroupVersionKind]bool{
	{Group: "monitoring.coreos.com", Version: "v1", Kind: "ServiceMonitor"}:              true,
	{Group: "monitoring.coreos.com", Version: "v1", Kind: "PodMonitor"}:                  true,
	{Group: "monitoring.coreos.com", Version: "v1", Kind: "PrometheusRule"}:              true,
	{Group: "trainer.kubeflow.org", Version: "v1alpha1", Kind: "TrainJob"}:               true,
	{Group: "trainer.kubeflow.org", Version: "v1alpha1", Kind: "ClusterTrainingRuntime"}: true,
	{Group: "trainer.kubeflow.org", Version: "v1alpha1", Kind: "TrainingRuntime"}:        true,
	{Group: "opentelemetry.io", Version: "v1alpha1", Kind: "Instrumentation"}:            true,
}

var customTopLevel = map[string]bool{"apiVersion": true, "kind": true, "metadata": true, "spec": true}

// customTypedParts: the parts of a CRD's spec whose type is a Kubernetes one, decoded strictly
// into it like a built-in object (the rest of the spec is not checked).
type typedPart struct {
	path []string // under spec
	into func() any
	env  bool // a list of EnvVar: $(VAR) references are checked too
}

var customTypedParts = map[schema.GroupVersionKind][]typedPart{
	{Group: "trainer.kubeflow.org", Version: "v1alpha1", Kind: "TrainJob"}: {
		{path: []string{"trainer", "env"}, into: func() any { return &[]corev1.EnvVar{} }, env: true},
		{path: []string{"trainer", "resourcesPerNode"}, into: func() any { return &corev1.ResourceRequirements{} }},
	},
	{Group: "opentelemetry.io", Version: "v1alpha1", Kind: "Instrumentation"}: {
		{path: []string{"env"}, into: func() any { return &[]corev1.EnvVar{} }, env: true},
		{path: []string{"python", "env"}, into: func() any { return &[]corev1.EnvVar{} }, env: true},
		{path: []string{"python", "resourceRequirements"}, into: func() any { return &corev1.ResourceRequirements{} }},
	},
	{Group: "monitoring.coreos.com", Version: "v1", Kind: "ServiceMonitor"}: {
		{path: []string{"selector"}, into: func() any { return &metav1.LabelSelector{} }},
	},
}

func newScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, networkingv1.AddToScheme,
		policyv1.AddToScheme, rbacv1.AddToScheme, autoscalingv2.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}

type checker struct {
	scheme  *runtime.Scheme
	decoder *kjson.Serializer
}

func newChecker() *checker {
	s := newScheme()
	// The API server's own strict decoding: YAML to JSON, case-sensitive field names, unknown
	// and duplicate fields reported as strict decoding errors.
	d := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, s, s, kjson.SerializerOptions{Yaml: true, Strict: true})
	return &checker{scheme: s, decoder: d}
}

// check returns a short description of the object and the problems found in it.
func (c *checker) check(doc []byte) (string, []string) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := yaml.Unmarshal(doc, &head); err != nil {
		return "?", []string{"not a YAML map: " + err.Error()}
	}
	what := fmt.Sprintf("%s %s", head.Kind, head.Metadata.Name)
	if head.APIVersion == "" || head.Kind == "" {
		return what, []string{"apiVersion and kind are required"}
	}
	gv, err := schema.ParseGroupVersion(head.APIVersion)
	if err != nil {
		return what, []string{err.Error()}
	}
	gvk := gv.WithKind(head.Kind)
	if customKinds[gvk] {
		return what, c.checkCustom(doc, customTypedParts[gvk])
	}
	if !c.scheme.Recognizes(gvk) {
		return what, []string{fmt.Sprintf("unknown kind %s (neither a k8s.io/api type this checker knows nor a listed CRD)", gvk)}
	}
	obj, _, err := c.decoder.Decode(doc, &gvk, nil)
	var problems []string
	if err != nil {
		// a strict decoding error (unknown or duplicate fields) still decodes the rest: go on
		// checking it; any other error leaves nothing to check
		if !runtime.IsStrictDecodingError(err) || obj == nil {
			return what, []string{err.Error()}
		}
		for _, e := range err.(interface{ Errors() []error }).Errors() {
			problems = append(problems, e.Error())
		}
	}
	return what, append(problems, checkObject(obj)...)
}

func (c *checker) checkCustom(doc []byte, parts []typedPart) []string {
	var top map[string]any
	if err := yaml.UnmarshalStrict(doc, &top); err != nil {
		return []string{err.Error()}
	}
	var problems []string
	var extra []string
	for key := range top {
		if !customTopLevel[key] {
			extra = append(extra, key)
		}
	}
	sort.Strings(extra)
	for _, key := range extra {
		problems = append(problems, fmt.Sprintf("unknown top-level field %q", key))
	}
	if spec, ok := top["spec"]; ok {
		specMap, isMap := spec.(map[string]any)
		if !isMap {
			problems = append(problems, "spec is not a map")
		}
		for _, part := range parts {
			problems = append(problems, checkTypedPart(specMap, part)...)
		}
	}
	raw, err := yaml.Marshal(top["metadata"])
	if err != nil {
		return append(problems, err.Error())
	}
	var meta metav1.ObjectMeta
	if err := yaml.UnmarshalStrict(raw, &meta); err != nil {
		return append(problems, "metadata: "+err.Error())
	}
	return append(problems, checkMeta(&meta)...)
}

func checkTypedPart(spec map[string]any, part typedPart) []string {
	var value any = spec
	for _, key := range part.path {
		m, ok := value.(map[string]any)
		if !ok {
			return nil
		}
		if value, ok = m[key]; !ok {
			return nil // absent: nothing to check
		}
	}
	where := "spec." + strings.Join(part.path, ".")
	raw, err := json.Marshal(value)
	if err != nil {
		return []string{where + ": " + err.Error()}
	}
	into := part.into()
	strictErrs, err := kjsonutil.UnmarshalStrict(raw, into)
	if err != nil {
		return []string{where + ": " + err.Error()}
	}
	var problems []string
	for _, e := range strictErrs {
		problems = append(problems, where+": "+e.Error())
	}
	if part.env {
		container := corev1.Container{Name: where, Env: *into.(*[]corev1.EnvVar)}
		problems = append(problems, checkPodSpec(&corev1.PodSpec{Containers: []corev1.Container{container}})...)
	}
	return problems
}

func checkMeta(meta *metav1.ObjectMeta) []string {
	var problems []string
	if meta.Name == "" {
		problems = append(problems, "metadata.name is required")
	} else {
		for _, msg := range validation.IsDNS1123Subdomain(meta.Name) {
			problems = append(problems, "metadata.name: "+msg)
		}
	}
	if meta.Namespace != "" {
		for _, msg := range validation.IsDNS1123Label(meta.Namespace) {
			problems = append(problems, "metadata.namespace: "+msg)
		}
	}
	for k, v := range meta.Labels {
		for _, msg := range validation.IsQualifiedName(k) {
			problems = append(problems, fmt.Sprintf("label key %q: %s", k, msg))
		}
		for _, msg := range validation.IsValidLabelValue(v) {
			problems = append(problems, fmt.Sprintf("label %s value %q: %s", k, v, msg))
		}
	}
	for k := range meta.Annotations {
		for _, msg := range validation.IsQualifiedName(strings.ToLower(k)) {
			problems = append(problems, fmt.Sprintf("annotation key %q: %s", k, msg))
		}
	}
	return problems
}

func checkObject(obj runtime.Object) []string {
	accessor, ok := obj.(metav1.Object)
	if !ok {
		return []string{"not an object with metadata"}
	}
	meta := metav1.ObjectMeta{Name: accessor.GetName(), Namespace: accessor.GetNamespace(),
		Labels: accessor.GetLabels(), Annotations: accessor.GetAnnotations()}
	problems := checkMeta(&meta)
	var selector *metav1.LabelSelector
	var template *corev1.PodTemplateSpec
	switch o := obj.(type) {
	case *appsv1.Deployment:
		selector, template = o.Spec.Selector, &o.Spec.Template
	case *appsv1.StatefulSet:
		selector, template = o.Spec.Selector, &o.Spec.Template
		for i := range o.Spec.VolumeClaimTemplates {
			problems = append(problems, checkMeta(&o.Spec.VolumeClaimTemplates[i].ObjectMeta)...)
		}
	case *appsv1.DaemonSet:
		selector, template = o.Spec.Selector, &o.Spec.Template
	case *appsv1.ReplicaSet:
		selector, template = o.Spec.Selector, &o.Spec.Template
	case *batchv1.Job:
		selector, template = o.Spec.Selector, &o.Spec.Template
	case *corev1.Pod:
		problems = append(problems, checkPodSpec(&o.Spec)...)
	}
	if template != nil {
		if selector == nil {
			if _, isJob := obj.(*batchv1.Job); !isJob {
				problems = append(problems, "spec.selector is required")
			}
		} else if sel, err := metav1.LabelSelectorAsSelector(selector); err != nil {
			problems = append(problems, "spec.selector: "+err.Error())
		} else if sel.Empty() || !sel.Matches(labels.Set(template.Labels)) {
			problems = append(problems, fmt.Sprintf("spec.selector %s does not select the pod template's labels %v", sel, template.Labels))
		}
		problems = append(problems, checkPodSpec(&template.Spec)...)
	}
	return problems
}

var varRef = regexp.MustCompile(`\$+\(([^)]*)\)`)

// checkPodSpec: every $(VAR) in a container's env values names a variable defined before it in
// the same container's env ($$(VAR) is an escaped literal and is skipped).
func checkPodSpec(spec *corev1.PodSpec) []string {
	var problems []string
	containers := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	for _, container := range containers {
		defined := map[string]bool{}
		for _, env := range container.Env {
			for _, m := range varRef.FindAllStringSubmatch(env.Value, -1) {
				dollars := len(m[0]) - len(m[1]) - 2
				if dollars%2 == 0 { // $$(X): escaped
					continue
				}
				if !defined[m[1]] {
					problems = append(problems, fmt.Sprintf("container %s: env %s refers to $(%s), which is not defined before it in the container's env (it would stay literal)", container.Name, env.Name, m[1]))
				}
			}
			defined[env.Name] = true
		}
	}
	return problems
}

func documents(r io.Reader) ([][]byte, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var docs [][]byte
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		// a document of comments only (helm's "# Source:" lines of an empty template) is no object
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, err
		}
		if t := bytes.TrimSpace(j); len(t) == 0 || string(t) == "null" {
			continue
		}
		docs = append(docs, doc)
	}
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: k8s-check FILE... (- for standard input)")
		os.Exit(2)
	}
	c := newChecker()
	failed, total := 0, 0
	for _, name := range os.Args[1:] {
		var r io.Reader = os.Stdin
		if name != "-" {
			f, err := os.Open(name)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(2)
			}
			defer f.Close()
			r = f
		}
		docs, err := documents(r)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
			os.Exit(2)
		}
		for i, doc := range docs {
			total++
			what, problems := c.check(doc)
			if len(problems) == 0 {
				fmt.Printf("ok    %s #%d %s\n", name, i+1, what)
				continue
			}
			failed++
			for _, p := range problems {
				fmt.Printf("FAIL  %s #%d %s: %s\n", name, i+1, what, p)
			}
		}
	}
	fmt.Printf("%d objects, %d failed\n", total, failed)
	if failed > 0 || total == 0 {
		os.Exit(1)
	}
}
