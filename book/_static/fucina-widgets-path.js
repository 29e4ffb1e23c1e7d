// Loaded between require.js and embed-amd.js (nb_ipywidgets_js in _config.yml).
// embed-amd.js defines named AMD modules ("@jupyter-widgets/base", ...) and finds its
// Font Awesome fonts relative to the URL require.js gives each module, which by default is
// "<page folder>/@jupyter-widgets/...": six 404s per page.  Map those module names to this
// folder (_static/), where the fonts are.  No file is fetched by this mapping: the modules are
// already defined by the embed-amd.js script tag.
(function () {
  var src = document.currentScript && document.currentScript.src;
  if (!src || typeof require === "undefined") return;
  var here = src.slice(0, src.lastIndexOf("/") + 1) + "embed-amd";
  var names = ["@jupyter-widgets/base", "@jupyter-widgets/controls",
               "@jupyter-widgets/html-manager",
               "@jupyter-widgets/html-manager/dist/libembed-amd"];
  var paths = {};
  names.forEach(function (name) { paths[name] = here; });
  require.config({ paths: paths });
})();
